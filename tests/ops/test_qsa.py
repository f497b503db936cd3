"""Vectorised QSA (selection + sparse attention) == the query-by-query spec in `ops.qsa_ref`."""

import pytest
import torch

from flashnext.batch import make_segments
from flashnext.ops import qsa
from flashnext.ops.qsa_ref import select_tokens_ref, sparse_attention_ref


def _case(lens, Hi=4, Di=8, ratio=4, seed=0, quantize=False):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    seg = make_segments(cu, T)
    idx_q = torch.randn(T, Hi, Di, generator=g, dtype=torch.float64)
    raw_k = torch.randn(T, Di, generator=g, dtype=torch.float64)
    if quantize:  # coarse values: many exactly equal block scores, exercising the tie rule
        idx_q, raw_k = idx_q.sign().clamp_min(0), raw_k.sign().clamp_min(0)
    starts = qsa.complete_blocks(seg, ratio)
    keys = qsa.pool_block_keys(raw_k, starts, ratio)
    return seg, idx_q, keys, starts


def _as_sets(sel, ok):
    return [sorted(s[o].tolist()) for s, o in zip(sel, ok, strict=True)]


@pytest.mark.parametrize(
    "lens", [[1], [3], [16], [40], [9, 0, 23, 1, 50]], ids=["len1", "short", "budget", "several", "packed"]
)
@pytest.mark.parametrize("quantize", [False, True], ids=["random", "ties"])
def test_selection_matches_reference(lens, quantize, monkeypatch):
    ratio, topk = 4, 3
    seg, idx_q, keys, starts = _case(lens, ratio=ratio, quantize=quantize)
    monkeypatch.setattr(qsa, "SCORE_BUDGET", 64)  # force several query chunks
    sel, ok = qsa.select_tokens(idx_q, keys, starts, seg, ratio, topk)
    assert sel.shape == (sum(lens), topk * ratio + ratio - 1)
    assert _as_sets(sel, ok) == select_tokens_ref(idx_q, keys, starts, seg.seq_start, ratio, topk)


def test_tie_rule_prefers_later_block():
    """All-zero scores: every block ties, so the latest `topk` complete blocks win."""
    lens = [20]
    seg, idx_q, keys, starts = _case(lens)
    sel, ok = qsa.select_tokens(torch.zeros_like(idx_q), keys, starts, seg, 4, 2)
    assert _as_sets(sel, ok)[19] == list(range(12, 20))  # blocks 3, 4; the tail is empty
    assert _as_sets(sel, ok)[13] == list(range(4, 14))  # blocks 1, 2 and tail 12..13


@pytest.mark.parametrize("groups", [1, 2])
def test_sparse_attention_matches_reference(groups, monkeypatch):
    lens = [9, 0, 23, 1, 30]
    seg, idx_q, keys, starts = _case(lens, seed=1)
    sel, ok = qsa.select_tokens(idx_q, keys, starts, seg, 4, 3)
    T, Hkv, D = sum(lens), 2, 8
    q = torch.randn(T, Hkv * groups, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, Hkv, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(T, Hkv, D, dtype=torch.float64, requires_grad=True)
    monkeypatch.setattr(qsa, "GATHER_BUDGET", 500)  # several query chunks
    out = qsa.sparse_attention(q, k, v, sel, ok, 0.3, seg, 4)
    ref = sparse_attention_ref(q, k, v, _as_sets(sel, ok), 0.3)
    # Both take the softmax in fp32 (as the reference's eager attention), hence fp32-level tolerances.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad((out * w).sum(), (q, k, v)),
        torch.autograd.grad((ref * w).sum(), (q, k, v)),
        rtol=1e-5,
        atol=1e-6,
    )
