"""Vectorised QSA (selection + sparse attention), over a stream and over a per-slot cache, == the query-by-query
spec in `ops.qsa_ref`."""

import pytest
import torch

from flashnext.batch import make_segments
from flashnext.ops import qsa, qsa_cached
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
    keys = qsa.pool_blocks(raw_k[qsa.block_rows(starts, ratio)])
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


@pytest.mark.parametrize("q_offset", [0, 13, 40])
def test_selection_of_a_slice_of_queries(q_offset, monkeypatch):
    """`q_offset` (context parallelism): queries that are rows q_offset.. of the stream select what those rows of
    the whole stream select."""
    lens = [9, 30, 1, 20]
    seg, idx_q, keys, starts = _case(lens, quantize=True)
    monkeypatch.setattr(qsa, "SCORE_BUDGET", 64)
    sel, ok = qsa.select_tokens(idx_q, keys, starts, seg, 4, 3)
    rows = slice(q_offset, q_offset + 12)
    part = qsa.select_tokens(idx_q[rows], keys, starts, seg, 4, 3, q_offset=q_offset)
    assert _as_sets(*part) == _as_sets(sel[rows], ok[rows])


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


@pytest.mark.parametrize(
    ("lens", "queries"),
    [([3], [3]), ([1, 9, 30], [1, 1, 1]), ([13, 40, 4], [5, 17, 4]), ([25, 25], [25, 1]), ([50], [19])],
    ids=["short-prefill", "decode", "chunks", "whole-and-decode", "one-slot-chunk"],
)
@pytest.mark.parametrize(("ratio", "topk"), [(4, 3), (2, 1), (8, 2)])
@pytest.mark.parametrize("quantize", [False, True], ids=["random", "ties"])
def test_cached_path_matches_reference(lens, queries, ratio, topk, quantize, monkeypatch):
    """Queries continuing cached sequences (the last `queries[i]` tokens of slot i) select and attend exactly as the
    spec over each whole sequence: the cache's block keys, rows-as-positions layout and tail all agree."""
    g = torch.Generator().manual_seed(7)
    Hi, Di, H, Hkv, D = 3, 8, 4, 2, 8
    S, Lc = len(lens), (max(lens) // ratio + 1) * ratio
    k_cache, v_cache = torch.zeros(S, Lc, Hkv, D, dtype=torch.float64), torch.zeros(S, Lc, Hkv, D, dtype=torch.float64)
    block_keys = torch.zeros(S, Lc // ratio, Di, dtype=torch.float64)
    q_rows, iq_rows, slot_rows, pos_rows, expected = [], [], [], [], []
    for slot, (L, n) in enumerate(zip(lens, queries, strict=True)):
        seg = make_segments(torch.tensor([0, L], dtype=torch.int32), L)
        idx_q = torch.randn(L, Hi, Di, generator=g, dtype=torch.float64)
        raw_k = torch.randn(L, Di, generator=g, dtype=torch.float64)
        if quantize:
            idx_q, raw_k = idx_q.sign().clamp_min(0), raw_k.sign().clamp_min(0)
        q = torch.randn(L, H, D, generator=g, dtype=torch.float64)
        k, v = (
            torch.randn(L, Hkv, D, generator=g, dtype=torch.float64),
            torch.randn(L, Hkv, D, generator=g, dtype=torch.float64),
        )
        starts = qsa.complete_blocks(seg, ratio)
        keys = qsa.pool_blocks(raw_k[qsa.block_rows(starts, ratio)])
        chosen = select_tokens_ref(idx_q, keys, starts, seg.seq_start, ratio, topk)
        expected.append(sparse_attention_ref(q, k, v, chosen, 0.3)[L - n :])
        k_cache[slot, :L], v_cache[slot, :L], block_keys[slot, : keys.shape[0]] = k, v, keys
        q_rows.append(q[L - n :])
        iq_rows.append(idx_q[L - n :])
        slot_rows.append(torch.full((n,), slot))
        pos_rows.append(torch.arange(L - n, L))
    tok_slot, tok_pos = torch.cat(slot_rows), torch.cat(pos_rows)
    monkeypatch.setattr(qsa_cached, "SCORE_BUDGET", 40)  # several query chunks on both kernels
    monkeypatch.setattr(qsa_cached, "GATHER_BUDGET", 700)
    max_visible = max(L // ratio for L in lens)
    blocks, ok = qsa_cached.select_blocks_cached(
        torch.cat(iq_rows), block_keys, tok_slot, tok_pos, max_visible, ratio, topk
    )
    if S == 1:  # one sequence: its block keys shared by every query (the long-prefill path) select the same
        shared = qsa_cached.select_blocks_cached(
            torch.cat(iq_rows), block_keys, tok_slot, tok_pos, max_visible, ratio, topk, slot=0
        )
        assert all(torch.equal(a, b) for a, b in zip(shared, (blocks, ok), strict=True))
    args = (torch.cat(q_rows), k_cache, v_cache, tok_slot, tok_pos, blocks, ok, 0.3, ratio)
    out = qsa_cached.sparse_attention_cached(*args)
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-6)
    # bf16 operands with the products on fp32 copies (eager serving on a CPU without bf16 GEMM instructions,
    # `model.fused.upcasts`) == the bf16 products: fp32 sums rounded once either way, in other orders, so the
    # scores and the softmax weights (both rounded to bf16) may land one bf16 step apart: bf16's tolerance
    low = tuple(a.to(torch.bfloat16) if a.is_floating_point() else a for a in args[:3]) + args[3:]
    upcast = qsa_cached.sparse_attention_cached(*low, fp32_products=True)
    assert upcast.dtype == torch.bfloat16
    torch.testing.assert_close(upcast, qsa_cached.sparse_attention_cached(*low), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(upcast.double(), out, rtol=3e-2, atol=3e-2)  # the bf16 rounding of q, k, v too
    if (ratio, topk) != (4, 3):
        return  # the traced twin below on one ratio: its cases take seconds each
    # traced by dynamo (as in the compiled decode step) the products are reductions: the same values
    ops = set()

    def backend(gm, example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()  # a fresh cache per case: the parametrised cases would exceed the recompile limit
    traced = torch.compile(qsa_cached.sparse_attention_cached, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(traced(*args), torch.cat(expected), rtol=1e-5, atol=1e-6)
    # traced, the fp32 copies are not taken: a compiled step's reductions sum in fp32 already
    torch.testing.assert_close(traced(*args, fp32_products=True), torch.cat(expected), rtol=1e-5, atol=1e-6)
    assert not any("matmul" in op or "bmm" in op for op in ops), ops
