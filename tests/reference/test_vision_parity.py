"""Our composite model == transformers' Qwen4ExpForConditionalGeneration (fp32), vision tower included.

One tiny composite reference (4 text layers incl. QSA with 8 indexer heads, 2 vision blocks, 4x4 position
table) with every float weight randomised (LayerNorms around 1, biases non-zero), saved and loaded with
`flashnext.from_pretrained`. Image grids (in patches, merge 2) cover a non-square grid whose position embedding
is a fractional interpolation of the 4x4 table (6x10), a grid equal to the table (4x4), a tall one (8x2) and a
two-frame one (2x4x6: attention per frame).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint import load_checkpoint
from flashnext.config import load_config
from flashnext.errors import CheckpointError, InputError
from flashnext.model.multimodal import FlashNextForConditionalGeneration, get_rope_index
from flashnext.model.text import FlashNextForCausalLM

VISION = dict(
    depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
)  # fmt: skip
IMG, VID, VS, VE = 100, 101, 98, 99  # image / video placeholder, vision start / end (vocab 128)
P = 3 * 2 * 4 * 4  # channels * temporal * patch * patch
GRIDS = {"6x10": (1, 6, 10), "4x4": (1, 4, 4), "8x2": (1, 8, 2), "2f4x6": (2, 4, 6)}


def _harness():
    """The oracle harness module (this folder's conftest.py), loaded by path: module-scoped fixtures here cannot
    take its function-scoped fixtures, and a bare `import conftest` could find tests/conftest.py instead."""
    spec = importlib.util.spec_from_file_location("_reference_harness", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HARNESS = _harness()


@torch.no_grad()
def _randomize_vision(visual: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in visual.named_parameters():
        rnd = torch.randn(p.shape, generator=gen)
        if ".norm" in name or name.startswith("norm"):
            p.copy_(rnd * 0.2 + (1.0 if name.endswith("weight") else 0.0))
        elif name.endswith("bias"):
            p.copy_(rnd * 0.2)
        elif name.startswith("pos_embed"):
            p.copy_(rnd * 0.5)
        else:  # fan-in scale; the Conv3d kernel's fan-in is all of one flattened patch
            p.copy_(rnd / math.sqrt(p[0].numel()))


def build_composite(seed: int = 0, **text_overrides) -> Qwen4ExpForConditionalGeneration:
    """The tiny composite reference, fp32 eval, eager attention, every float weight randomised from `seed`."""
    cfg = Qwen4ExpConfig(
        text_config=HARNESS.tiny_text_config(**text_overrides),
        vision_config=dict(VISION),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    torch.manual_seed(seed)
    ref = Qwen4ExpForConditionalGeneration._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    HARNESS.randomize_reference(ref, seed)
    _randomize_vision(ref.model.visual, seed + 100)
    return ref.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    ref = build_composite(seed=1)
    path = tmp_path_factory.mktemp("vlm") / "ref"
    ref.save_pretrained(path)
    ours = flashnext.from_pretrained(path)
    return ref, ours, path


def _pixels(grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, P, generator=torch.Generator().manual_seed(seed))


def _prompt(pre, grids, post):
    ids = list(pre)
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE] + [5, 6]
    return ids + list(post)


def _batch(seed=0):
    """3 right-padded prompts: one image, two images of different grids (with an EOS), text only."""
    per_seq = [[GRIDS["6x10"]], [GRIDS["4x4"], GRIDS["8x2"]], []]
    seqs = [_prompt([7, 8, 9], per_seq[0], [10, 11, 12]), _prompt([20], per_seq[1], [21, 3, 22]), list(range(30, 41))]
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    grids = [g for gs in per_seq for g in gs]
    return ids, mask, torch.tensor(grids), _pixels(grids, seed), [len(s) for s in seqs]


def test_vision_features(pair, rel_error):
    ref, ours, _ = pair
    grid = torch.tensor(list(GRIDS.values()))
    px = _pixels(GRIDS.values(), seed=1)
    with torch.no_grad():
        want = torch.cat(ref.model.get_image_features(px, grid).pooler_output)
        got = ours.get_image_features(px, grid)
    assert got.shape == want.shape == (sum(t * h * w for t, h, w in GRIDS.values()) // 4, 32)
    assert rel_error(got, want) <= 1e-4
    # Each image alone gives its own slice: attention never crosses images or frames.
    with torch.no_grad():
        alone = ours.get_image_features(_pixels([GRIDS["4x4"]], seed=2), torch.tensor([GRIDS["4x4"]]))
        mixed = ours.get_image_features(_pixels([GRIDS["4x4"]], seed=2).repeat(2, 1), torch.tensor([GRIDS["4x4"]] * 2))
    torch.testing.assert_close(mixed, alone.repeat(2, 1), rtol=1e-5, atol=1e-6)


def test_padded_logits_loss_and_grads(pair, rel_error):
    ref, ours, _ = pair
    ids, mask, grid, px, _ = _batch()
    labels = torch.where(mask.bool() & (ids != IMG), ids, -100)
    px_ref, px_ours = px.clone().requires_grad_(True), px.clone().requires_grad_(True)
    ref_out = ref(
        input_ids=ids, attention_mask=mask, pixel_values=px_ref, image_grid_thw=grid,
        mm_token_type_ids=(ids == IMG).long(), labels=labels,
    )  # fmt: skip
    our_out = ours(ids, attention_mask=mask, pixel_values=px_ours, image_grid_thw=grid, labels=labels)
    keep = mask.bool()
    assert rel_error(our_out.logits[keep], ref_out.logits[keep]) <= 1e-4
    assert rel_error(our_out.loss, ref_out.loss) <= 1e-5
    ref_out.loss.backward()
    our_out.loss.backward()
    assert rel_error(px_ours.grad, px_ref.grad) <= 1e-3
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        rp = ref_params[name]
        if rp.grad is None:  # the QSA indexer: discrete selection, no gradient in either model
            assert "indexer" in name and (p.grad is None or p.grad.abs().max() == 0), name
            continue
        assert rel_error(p.grad, rp.grad) <= 1e-3, name
        checked += 1
    assert checked == len(ref_params) - sum("indexer" in n for n in ref_params)
    assert ours.model.visual.pos_embed.weight.grad.abs().sum() > 0


def test_packed_equals_reference_and_each_alone(pair, rel_error):
    ref, ours, _ = pair
    ids, mask, grid, px, lens = _batch(seed=3)
    keep = mask.bool()
    with torch.no_grad():
        ref_logits = ref(
            input_ids=ids, attention_mask=mask, pixel_values=px, image_grid_thw=grid,
            mm_token_type_ids=(ids == IMG).long(),
        ).logits[keep]  # fmt: skip
        flat = ids[keep]
        cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        packed = ours(flat, cu_seqlens=cu, pixel_values=px, image_grid_thw=grid).logits
        assert rel_error(packed, ref_logits) <= 1e-4
        # Positions: ours == the reference's get_rope_index on the padded batch.
        ref_pos, ref_delta = ref.model.get_rope_index(ids, (ids == IMG).long(), grid, attention_mask=mask)
        pos, delta = get_rope_index(flat, cu.tolist(), (flat == IMG).long(), grid, 2)
        assert torch.equal(pos, ref_pos[:, keep]) and torch.equal(delta, ref_delta.view(-1))
        # Each sequence alone, with only its own images.
        first_px, first_img = 0, 0
        for n in range(len(lens)):
            a, b = int(cu[n]), int(cu[n + 1])
            n_img = sum(1 for t in flat[a:b].tolist() if t == VS)
            g = grid[first_img : first_img + n_img]
            n_px = int(g.prod(-1).sum())
            kwargs = dict(pixel_values=px[first_px : first_px + n_px], image_grid_thw=g) if n_img else {}
            alone = ours(flat[a:b], **kwargs).logits
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-5)
            first_px, first_img = first_px + n_px, first_img + n_img


def test_engine_image_prompt_equals_reference_generate(pair):
    """Serving: the engine's greedy tokens for a 2-image prompt (prefill chunked across the images, beside a text
    request) equal the reference's cached `generate` with the same pixels: MRoPE prefill + `delta` decode."""
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    ref, ours, _ = pair
    grids = [GRIDS["6x10"], GRIDS["8x2"]]
    prompt, px, grid = _prompt([7, 8, 9], grids, [10, 11, 12]), _pixels(grids, seed=4), torch.tensor(grids)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(
            ids, attention_mask=torch.ones_like(ids), pixel_values=px, image_grid_thw=grid, max_new_tokens=16,
            mm_token_type_ids=(ids == IMG).long(),  # the processor gives it; generate does not derive it
            do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    want = out.sequences[0, len(prompt) :].tolist()
    want_lp = torch.stack([torch.log_softmax(x[0].float(), -1)[t] for x, t in zip(out.logits, want, strict=True)])
    engine = Engine(ours, max_slots=2, max_model_len=96, max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    img = engine.add_request(prompt, params, pixel_values=px, image_grid_thw=grid)
    txt = engine.add_request(list(range(30, 41)), params)
    while not (img.finished and txt.finished):
        engine.step()
    assert img.output_ids == want
    torch.testing.assert_close(torch.tensor(img.logprobs), want_lp, rtol=0, atol=1e-4)


def test_placeholder_count_mismatch_names_both_counts(pair):
    _, ours, _ = pair
    ids, mask, grid, px, _ = _batch()
    # 15 + 4 + 4 placeholders; without the first (6x10) image only 8 features remain.
    with pytest.raises(InputError, match=r"23 image_token_id=100 placeholders .*, 8 image features"):
        ours(ids, attention_mask=mask, pixel_values=px[60:], image_grid_thw=grid[1:])


def test_roundtrip_through_transformers(pair, tmp_path, rel_error):
    """ours -> save_pretrained -> transformers loads every key -> same logits; the visual tensors are unchanged."""
    ref, ours, path = pair
    save_pretrained(ours, tmp_path / "ours")
    back, info = Qwen4ExpForConditionalGeneration.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    on_disk, ref_disk = load_file(tmp_path / "ours" / "model.safetensors"), load_file(path / "model.safetensors")
    visual = [k for k in ref_disk if k.startswith("model.visual.")]
    assert visual and all(torch.equal(on_disk[k], ref_disk[k]) for k in visual)
    ids, mask, grid, px, _ = _batch(seed=5)
    ids, mask, grid, px = ids[1:2], mask[1:2], grid[1:], px[60:]  # the two-image prompt
    mm = (ids == IMG).long()
    with torch.no_grad():
        a = back.eval()(input_ids=ids, attention_mask=mask, pixel_values=px, image_grid_thw=grid, mm_token_type_ids=mm)
        b = ours(ids, attention_mask=mask, pixel_values=px, image_grid_thw=grid)
    assert rel_error(b.logits[mask.bool()], a.logits[mask.bool()]) <= 1e-4


def test_language_model_only_checkpoint(pair, tmp_path, rel_error):
    """A text-only composite checkpoint (no model.visual.*, language_model_only) loads with no vision tower."""
    ref, _, path = pair
    (tmp_path / "lmo").mkdir()
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if not k.startswith("model.visual.")}
    save_file(tensors, tmp_path / "lmo" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "lmo" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="sets `language_model_only: true`") as info:
        flashnext.from_pretrained(tmp_path / "lmo")  # the config still promises a vision tower
    assert info.value.problems and all(x.startswith("missing: model.visual.") for x in info.value.problems)
    (tmp_path / "lmo" / "config.json").write_text(json.dumps({**cfg, "language_model_only": True}))

    text = flashnext.from_pretrained(tmp_path / "lmo")
    assert isinstance(text, FlashNextForCausalLM) and text.extra_tensors == {}
    composite = FlashNextForConditionalGeneration(load_config(tmp_path / "lmo"))
    assert composite.visual is None and not any("visual" in k for k in composite.state_dict())
    load_checkpoint(composite, tmp_path / "lmo")
    composite.reset_buffers()
    ids, mask, *_ = _batch()
    ids, mask = ids[2:], mask[2:]  # the text-only prompt
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        for model in (text, composite):
            assert rel_error(model(ids, attention_mask=mask).logits[mask.bool()], want) <= 1e-4
    with pytest.raises(InputError, match="no vision tower"):
        composite(ids, pixel_values=_pixels([(1, 4, 4)]), image_grid_thw=torch.tensor([[1, 4, 4]]))


def test_processed_image_matches_reference(pair, rel_error):
    """PIL image and data URL -> the registered transformers processor -> same logits as the reference."""
    pil = pytest.importorskip("PIL.Image")
    from flashnext.vision_inputs import image_processor, image_span, process_images

    ref, ours, _ = pair
    vision = ours.model_config.vision_config
    proc = image_processor(vision, min_pixels=8 * 8, max_pixels=40 * 40)
    g = torch.Generator().manual_seed(0)
    img = pil.fromarray((torch.rand(37, 21, 3, generator=g) * 255).to(torch.uint8).numpy())
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    a = process_images([img], vision, proc)
    b = process_images([url], vision, proc)
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.image_grid_thw, b.image_grid_thw)
    t, h, w = a.image_grid_thw[0].tolist()
    assert h != w and a.num_tokens == [t * h * w // 4]
    ids = torch.tensor([[7, 8, *image_span(a.num_tokens[0], IMG, VS, VE), 9, 10]])
    with torch.no_grad():
        want = ref(
            input_ids=ids, pixel_values=a.pixel_values, image_grid_thw=a.image_grid_thw,
            mm_token_type_ids=(ids == IMG).long(),
        ).logits  # fmt: skip
        got = ours(ids, pixel_values=b.pixel_values, image_grid_thw=b.image_grid_thw).logits
    assert rel_error(got, want) <= 1e-4
