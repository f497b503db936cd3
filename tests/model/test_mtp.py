"""The MTP draft head: its forward against a per-token reference written from the formula, and the serving
draft step (chunked cells, chained draft steps) against the same reference. fp32 throughout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashnext.batch import make_segments
from flashnext.config import parse_config
from flashnext.errors import InputError
from flashnext.model.state import make_step
from flashnext.model.text import FlashNextForCausalLM
from flashnext.serve import prepare_for_inference
from flashnext.serve.cache import StateCache


@pytest.fixture
def model(small_config):
    model = FlashNextForCausalLM(parse_config({**small_config, "mtp_num_hidden_layers": 1}).text).eval()
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight perturbed: the (1 + w) norms and zero-initialised parts matter too
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return prepare_for_inference(model)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's (1 + w) RMSNorm over the last dim, written out."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _cell_inputs(model, residual: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """The formula, cell by cell: fc_hidden(norm_{hc*D}(R_i).view(hc, D)) + fc_embedding(norm_D(embed(x_{i+1})))."""
    mtp, cfg = model.mtp, model.config
    hc, D, eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
    cells = []
    for r, tok in zip(residual, next_ids.tolist(), strict=True):
        e = _norm(model.model.embed_tokens.weight[tok], mtp.pre_fc_norm_embedding.weight, eps)
        e = e @ mtp.fc_embedding.weight.T
        h = _norm(r, mtp.pre_fc_norm_hidden.weight, eps).view(hc, D) @ mtp.fc_hidden.weight.T  # ONE norm over hc*D
        cells.append((h + e).flatten())
    return torch.stack(cells)


def _reference(model, residual: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token i: the layer (plain forward, no cache) over cells 0..i of one sequence at positions 0..i, its
    last row mixed and projected by the shared lm_head. -> (draft logits [T, V], R_next [T, hc*D])."""
    x = _cell_inputs(model, residual, next_ids)
    layer, logits, r_next = model.mtp.layers[0], [], []
    for i in range(x.shape[0]):
        seg = make_segments(torch.tensor([0, i + 1], dtype=torch.int32), i + 1)
        rope = model.model.rotary(seg.position_ids, x.dtype)
        out, _ = layer(x[: i + 1], None, rope, seg)
        r_next.append(out[-1])
        y = model.mtp.hyper_connection_mixer(out[-1:])
        logits.append(F.linear(y, model.lm_head.weight)[0])
    return torch.stack(logits), torch.stack(r_next)


def _trunk(model, ids: list[int]) -> torch.Tensor:
    seg = make_segments(torch.tensor([0, len(ids)], dtype=torch.int32), len(ids))
    _, _, residual = model.model(torch.tensor(ids), seg)
    return residual


@torch.no_grad()
def test_training_forward_equals_per_token_formula(model):
    """`return_mtp` over a packed stream of two sequences: cell i = (R_i, x_{i+1}) equals the reference for every
    cell with a next token, in each sequence independently (no attention across the boundary)."""
    seqs = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 11)]
    ids = torch.tensor(seqs[0] + seqs[1])
    out = model(ids, cu_seqlens=torch.tensor([0, 19, 30], dtype=torch.int32), return_mtp=True)
    starts = [0, 19]
    for seq, s in zip(seqs, starts, strict=True):
        want, _ = _reference(model, _trunk(model, seq)[:-1], torch.tensor(seq[1:]))
        got = out.mtp_logits[s : s + len(seq) - 1]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.mtp_logits).all()
    # The trunk's logits do not depend on asking for the head.
    torch.testing.assert_close(out.logits, model(ids, cu_seqlens=torch.tensor([0, 19, 30], dtype=torch.int32)).logits)


@torch.no_grad()
@pytest.mark.parametrize("chunks", [[17], [6, 1, 10], [1] * 17], ids=["one-shot", "chunked", "per-cell"])
def test_draft_step_equals_reference(model, chunks):
    """The serving head: cells fed in chunks into its own cache give each chunk's last draft logits; then two
    chained draft steps (the previous R_next + the draft token at the next position) equal the reference over
    the extended sequence of cells."""
    ids = torch.randint(0, 64, (18,), generator=torch.Generator().manual_seed(5)).tolist()
    residual = _trunk(model, ids)[:-1]  # cells 0..16, next tokens ids[1..17]
    next_ids = torch.tensor(ids[1:])
    cache = StateCache(model, max_slots=2, max_model_len=40)
    slot, done, got = cache.allocate(), 0, []
    for n in chunks:
        step = make_step([0, n], [slot], [done], cache.scratch_slot)
        logits, r_next = model.draft_step(residual[done : done + n], next_ids[done : done + n], step, cache)
        got.append(logits[0])
        done += n
    want, want_r = _reference(model, residual, next_ids)
    ends = torch.tensor(chunks).cumsum(0) - 1
    torch.testing.assert_close(torch.stack(got), want[ends], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_next[-1], want_r[-1], atol=1e-5, rtol=1e-5)
    # Draft steps: cell 17 = (R_next of cell 16, draft d1), cell 18 = (R_next of cell 17, d2).
    cells_r, cells_tok, ref_r, r = list(residual), next_ids.tolist(), want_r[-1], r_next[-1:]
    for j, d in enumerate([int(logits.argmax()), 7]):
        step = make_step([0, 1], [slot], [17 + j], cache.scratch_slot)
        logits, r = model.draft_step(r, torch.tensor([d]), step, cache)
        cells_r.append(ref_r)
        cells_tok.append(d)
        ref_logits, ref_rs = _reference(model, torch.stack(cells_r), torch.tensor(cells_tok))
        torch.testing.assert_close(logits[0], ref_logits[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r[0], ref_rs[-1], atol=1e-5, rtol=1e-5)
        ref_r = ref_rs[-1]


def test_head_absent_is_refused(small_config):
    model = FlashNextForCausalLM(parse_config(small_config).text)
    assert model.mtp is None and len(model.state_spec(8)) == small_config["num_hidden_layers"]
    with pytest.raises(InputError, match="return_mtp=True but this model has no MTP head"):
        model(torch.tensor([[1, 2, 3]]), return_mtp=True)


def test_head_keys_and_cache(model, small_config):
    """The official `mtp.*` names (31 tensors with stacked experts), and one more cache layer: the head's QSA."""
    names = [k for k in model.state_dict() if k.startswith("mtp.")]
    assert len(names) == 31
    assert "mtp.pre_fc_norm_hidden.weight" in names and model.mtp.pre_fc_norm_hidden.weight.shape == (2 * 16,)
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in names
    assert not any(".ple." in k or "linear_attn" in k for k in names)
    spec = model.state_spec(32)
    assert len(spec) == small_config["num_hidden_layers"] + 1 and set(spec[-1]) == {"self_attn"}
