"""The composite model's own pieces, without the oracle: interpolation vs F.interpolate, MRoPE index, packing
image-bearing sequences, freezing the tower, optimizer groups, input errors, image-source decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashnext.batch import PackedBatch
from flashnext.config import parse_config
from flashnext.errors import ConfigError, InputError
from flashnext.model.multimodal import FlashNextForConditionalGeneration, get_rope_index
from flashnext.model.text import FlashNextForCausalLM
from flashnext.model.vision import merge_block_coords, position_taps
from flashnext.train.optim import FROZEN, OptimConfig, build_optimizer, classify

IMG, VS, VE = 60, 58, 59
VISION = dict(
    depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=2, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=16, num_position_embeddings=9,
)  # fmt: skip
P = 3 * 2 * 2 * 2


def _config(small_config, **top):
    return parse_config(
        dict(
            model_type="qwen4_exp",
            text_config=small_config,
            vision_config=dict(VISION),
            image_token_id=IMG,
            vision_start_token_id=VS,
            vision_end_token_id=VE,
            **top,
        )  # fmt: skip
    )


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    m = FlashNextForConditionalGeneration(_config(small_config))
    m.init_weights(seed=0)
    with torch.no_grad():  # identity LayerNorms and zero biases would hide a skipped norm or bias
        for p in m.model.visual.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * 0.2)
        m.model.visual.pos_embed.weight.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("hw", [(6, 10), (2, 2), (14, 4), (3, 3)], ids=lambda hw: f"{hw[0]}x{hw[1]}")
def test_position_taps_equal_bilinear_align_corners_interpolate(hw):
    """Gathered taps == F.interpolate(bilinear, align_corners=True) of the table, forward and backward."""
    h, w = hw
    side, C, m = 3, 5, 1 if h % 2 else 2
    table = torch.randn(side * side, C, dtype=torch.float64, requires_grad=True)
    taps, weights = position_taps([(1, h, w)], side, m)
    ours = (table[taps] * weights[..., None].double()).sum(1)
    grid = F.interpolate(table.T.reshape(1, C, side, side), size=(h, w), mode="bilinear", align_corners=True)
    rows, cols = merge_block_coords(h, w, m)
    want = grid[0][:, rows, cols].T
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    probe = torch.randn_like(want)
    (g_ours,) = torch.autograd.grad((ours * probe).sum(), table)
    (g_want,) = torch.autograd.grad((want * probe).sum(), table)
    torch.testing.assert_close(g_ours, g_want, rtol=1e-6, atol=1e-6)  # fp32 weights, as the reference


def test_rope_index_by_hand():
    # 2 text, image (1, 4, 6) -> merged 2 x 3 = 6 placeholders, 2 text; then a text-only sequence of 3.
    types = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0])
    pos, delta = get_rope_index(torch.zeros(13, dtype=torch.long), [0, 10, 13], types, torch.tensor([[1, 4, 6]]), 2)
    assert pos.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 0, 1, 2],
        [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 0, 1, 2],
        [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 0, 1, 2],
    ]
    assert delta.tolist() == [7 - 10, 0]
    with pytest.raises(InputError, match="6 placeholder tokens but its grid"):
        get_rope_index(torch.zeros(10), [0, 10], types[:10], torch.tensor([[1, 4, 4]]), 2)
    with pytest.raises(InputError, match="has 2 images"):
        get_rope_index(torch.zeros(10), [0, 10], types[:10], torch.tensor([[1, 4, 6], [1, 2, 2]]), 2)


def _sequence(grids, pre, post, seed):
    ids = list(pre)
    for t, h, w in grids:
        ids += [VS] + [IMG] * (t * h * w // 4) + [VE]
    ids += post
    n_px = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    batch = PackedBatch.from_sequences([ids], [ids])
    if grids:
        batch.pixel_values = torch.randn(n_px, P, generator=gen)
        batch.image_grid_thw = torch.tensor(grids)
        batch.mm_token_type_ids = (batch.input_ids == IMG).long()
    return batch


def test_packed_image_sequences_equal_each_alone(model):
    parts = [
        _sequence([(1, 4, 6)], [5, 6], [7, 8, 9], seed=0),
        _sequence([(1, 2, 2), (2, 4, 2)], [10], [3, 11], seed=1),
        _sequence([(1, 6, 2)], [], [12], seed=2),
    ]
    packed = PackedBatch.concat(parts)
    assert packed.image_grid_thw.shape == (4, 3) and packed.cu_seqlens.tolist() == [0, 13, 25, 31]
    out = model(packed.input_ids, cu_seqlens=packed.cu_seqlens, labels=packed.labels, **packed.image_kwargs())
    for n, part in enumerate(parts):
        a, b = packed.cu_seqlens[n : n + 2].tolist()
        alone = model(part.input_ids, cu_seqlens=part.cu_seqlens, **part.image_kwargs()).logits
        torch.testing.assert_close(out.logits[a:b], alone, rtol=1e-5, atol=1e-5)
    # Explicit [3, T] positions (the model's own rope index) give the same logits.
    pos, _ = get_rope_index(
        packed.input_ids, packed.cu_seqlens.tolist(), packed.mm_token_type_ids, packed.image_grid_thw, 2
    )
    again = model(packed.input_ids, cu_seqlens=packed.cu_seqlens, position_ids=pos, **packed.image_kwargs())
    torch.testing.assert_close(again.logits, out.logits)
    out.loss.backward()
    visual = model.model.visual
    for p in (visual.pos_embed.weight, visual.patch_embed.proj.weight, visual.blocks[0].attn.qkv.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_freeze_vision_and_optimizer_groups(model, small_config):
    model.freeze_vision()
    ids = _sequence([(1, 4, 6)], [5], [6], seed=0)
    model(ids.input_ids, labels=ids.labels, **ids.image_kwargs()).loss.backward()
    assert all(p.grad is None for p in model.model.visual.parameters())
    assert model.model.language_model.embed_tokens.weight.grad is not None
    optimizers, report = build_optimizer(model, OptimConfig())
    visual = {n: g for n, g in report.items() if n.startswith("model.visual.")}
    assert visual and set(visual.values()) == {FROZEN}
    in_optim = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in in_optim for p in model.model.visual.parameters())
    # The decoder under model.language_model.* is grouped exactly like the text model's model.*.
    text = FlashNextForCausalLM(model.config)
    _, text_report = build_optimizer(text, OptimConfig())
    composite = {n.replace("model.language_model.", "model."): g for n, g in report.items() if "visual" not in n}
    assert composite == text_report
    model.freeze_vision(False)
    assert classify("model.visual.blocks.0.attn.qkv.weight", torch.zeros(3, 2)) == "adamw_decay"
    assert classify("model.visual.patch_embed.proj.weight", torch.zeros(4, 3, 2, 2, 2)) == "adamw_decay"
    assert classify("model.visual.merger.norm.bias", torch.zeros(4)) == "adamw_no_decay"


def test_input_errors(model):
    ids = _sequence([(1, 4, 6)], [5], [6], seed=0)
    kw = ids.image_kwargs()
    with pytest.raises(InputError, match=r"pixel_values has shape \(24, 24\) but image_grid_thw needs \(48, 24\)"):
        model(ids.input_ids, pixel_values=kw["pixel_values"], image_grid_thw=torch.tensor([[2, 4, 6]]))
    with pytest.raises(InputError, match=r"image_grid_thw\[0\]=\(1, 3, 8\).*multiples of spatial_merge_size=2"):
        model(ids.input_ids, pixel_values=kw["pixel_values"], image_grid_thw=torch.tensor([[1, 3, 8]]))
    with pytest.raises(InputError, match="pixel_values given without image_grid_thw"):
        model(ids.input_ids, pixel_values=kw["pixel_values"])


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(mm_token_type_ids=torch.zeros(5, dtype=torch.long)),
            r"mm_token_type_ids shape \(5,\) != input_ids shape",
        ),
        (dict(mm_token_type_ids="float"), "mm_token_type_ids must be an integer tensor"),
        (dict(image_grid_thw=torch.tensor([[4, 6]])), r"image_grid_thw must be \[n_images, 3\].*got \(1, 2\)"),
        (dict(image_grid_thw=torch.tensor([[1.0, 4.0, 6.0]])), "image_grid_thw must be an integer tensor"),
        (dict(pixel_values=torch.zeros(24, 5)), r"pixel_values must be \[n_patches, 24\].*got \(24, 5\)"),
        (dict(pixel_values=torch.zeros(24, 24, dtype=torch.long)), "pixel_values must be a floating-point tensor"),
        (dict(labels=torch.zeros(3, dtype=torch.long)), r"labels shape \(3,\) != input_ids shape"),
        (dict(attention_mask="ones"), "attention_mask is for padded"),
        (
            dict(position_ids=torch.zeros(2, 10, dtype=torch.long)),
            r"\[T\] or \[3, T\] \(MRoPE\) with T=10, got shape \(2, 10\)",
        ),
    ],
)
def test_composite_input_battery(model, change, match):
    """Each bad argument of the composite forward is named (host-side checks, before the tower runs)."""
    seq = _sequence([(1, 4, 6)], [5], [6], seed=0)
    kw = dict(labels=seq.labels, **seq.image_kwargs())
    for name, value in change.items():
        if value == "float":
            value = kw[name].float()
        elif value == "ones":
            value = torch.ones_like(seq.input_ids)
        kw[name] = value
    with pytest.raises(InputError, match=match):
        model(seq.input_ids, **kw)


def test_composite_empty_batch(model):
    with torch.no_grad():
        out = model(torch.zeros(0, 4, dtype=torch.long), attention_mask=torch.zeros(0, 4))
    assert out.logits.shape == (0, 4, 64)


def test_config_errors(small_config):
    with pytest.raises(ConfigError, match="out_hidden_size=8 != text hidden_size=16"):
        FlashNextForConditionalGeneration(parse_config(dict(
            model_type="qwen4_exp", text_config=small_config, vision_config={**VISION, "out_hidden_size": 8}
        )))  # fmt: skip
    with pytest.raises(ConfigError, match="num_position_embeddings=10 is not a square"):
        _config(small_config).vision_config.__class__.from_dict({**VISION, "num_position_embeddings": 10})
    lmo = _config(small_config, language_model_only=True)
    assert lmo.vision_config is None
    assert FlashNextForConditionalGeneration(lmo).visual is None


def test_image_sources():
    from flashnext.vision_inputs import _require, load_image

    with pytest.raises(InputError, match="remote image URLs are not supported"):
        load_image("https://example.com/cat.png")
    with pytest.raises(InputError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(InputError, match="cannot decode image"):
        load_image("data:image/png;base64,aGVsbG8=")
    with pytest.raises(ImportError, match="pip install transformers pillow"):
        _require("flashnext_no_such_module", "transformers")


def test_composite_mtp_head_equals_the_text_models(small_config):
    """The composite model's MTP head (`mtp.*` beside `model.language_model.*`): on text, its draft logits, MTP
    loss and gradients equal the text model's with the same weights; on an image sequence its loss reaches the
    vision tower (through the trunk's residual). Serving's draft logits of an image prompt against these:
    `tests/serve/test_image_serving.py`."""
    cfg = _config({**small_config, "mtp_num_hidden_layers": 1})
    comp = FlashNextForConditionalGeneration(cfg)
    comp.init_weights(seed=0)
    assert comp.mtp is not None
    text = FlashNextForCausalLM(cfg.text)
    renamed = {k.replace("model.language_model.", "model."): v for k, v in comp.state_dict().items()}
    text.load_state_dict({k: v for k, v in renamed.items() if not k.startswith("model.visual.")})
    b = _sequence([], [5, 6, 7, 8, 9, 10, 11, 12, 13], [], seed=0)
    got = comp(b.input_ids, cu_seqlens=b.cu_seqlens, labels=b.labels, return_mtp=True)
    want = text(b.input_ids, cu_seqlens=b.cu_seqlens, labels=b.labels, return_mtp=True)
    torch.testing.assert_close(got.mtp_logits, want.mtp_logits, rtol=0, atol=0)  # the same ops on the same values
    got.mtp_loss.backward()
    want.mtp_loss.backward()
    torch.testing.assert_close(comp.mtp.fc_hidden.weight.grad, text.mtp.fc_hidden.weight.grad, rtol=0, atol=0)

    image = _sequence([(1, 4, 6)], [5, 6], [7, 8, 9, 10], seed=1)
    out = comp(image.input_ids, cu_seqlens=image.cu_seqlens, labels=image.labels, return_mtp=True,
               **image.image_kwargs())  # fmt: skip
    assert torch.isfinite(out.mtp_loss) and out.mtp_logits.shape == (image.num_tokens, cfg.text.vocab_size)
    comp.zero_grad()
    out.mtp_loss.backward()
    assert comp.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
