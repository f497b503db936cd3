"""QSA against a per-slot cache: block selection and sparse attention for queries that continue cached sequences.

The cache holds, per slot, every token's rotated key/value (`[S, Lc, Hkv, D]`, position p at row p) and every
complete block's normalised, rotated mean indexer key (`[S, NBS, Di]`, written once when the block completes).
Because rows are positions, block b of a slot is rows `b*c .. b*c+c-1`: one `c x Hkv x D` row of the cache viewed
as `[S * NBS, c, Hkv, D]`, so a query gathers its selected blocks and its tail block as whole rows.

Selection equals `ops.qsa` (and `ops.qsa_ref`): the query at position p sees blocks `0 .. (p+1)//c - 1` of its
slot plus the tail `(p+1)//c * c .. p`, ranked by `ops.qsa.rank_blocks` (the one scoring and tie rule of training
and serving): top `block_topk` blocks, ties to the higher score, then the later block.

Legend: T queries, Tq queries in a chunk, S slots, NBS block rows per slot, NB visible blocks, kb selected blocks,
Hi/Di indexer heads/dim, H/Hkv attention heads, G = H / Hkv, D head dim, c compress ratio.
"""

from __future__ import annotations

import torch

from flashnext.ops.qsa import rank_blocks

SCORE_BUDGET = 1 << 22  # elements of the gathered [Tq, NB, Di] block keys per chunk
GATHER_BUDGET = 1 << 22  # elements of the gathered [Tq, n, Hkv, D] keys per chunk


@torch.no_grad()
def select_blocks_cached(
    idx_q: torch.Tensor,
    block_keys: torch.Tensor,
    tok_slot: torch.Tensor,
    tok_pos: torch.Tensor,
    max_visible: int,
    ratio: int,
    block_topk: int,
    slot: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top blocks of every query within its slot.

    Args:
        idx_q: [T, Hi, Di] normalised, rotated indexer queries; block_keys: [S, NBS, Di] (cache).
        tok_slot, tok_pos: int64 [T] slot and absolute position of every query.
        max_visible: host int, the most complete blocks any query of the step sees.
        slot: host int when every query is in that one slot (a step of one sequence: a long chunked prefill).
            Its block keys are then read once, shared by every query, instead of gathered per query: at 131k
            tokens that gather is 8 MiB per query.

    Returns:
        blocks int64 [T, kb] block indices within the slot (0 where unused) and ok bool [T, kb].
    """
    T, Hi, Di = idx_q.shape
    kb = min(block_topk, max_visible)
    device = idx_q.device
    if kb == 0 or T == 0:
        return torch.zeros(T, 0, dtype=torch.long, device=device), torch.zeros(T, 0, dtype=torch.bool, device=device)
    nvis = (tok_pos + 1) // ratio
    b = torch.arange(max_visible, device=device)
    shared = None if slot is None else block_keys[slot, :max_visible]  # [NB, Di]
    step = max(1, SCORE_BUDGET // (max_visible * (Di if shared is None else Hi)))  # [Tq, NB, Di] or [Tq, Hi, NB]
    blocks, oks = [], []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        keys = shared if shared is not None else block_keys[:, :max_visible].index_select(0, tok_slot[t0:t1])
        order, ok = rank_blocks(idx_q[t0:t1], keys, b[None, :] < nvis[t0:t1, None], kb)
        oks.append(ok)
        blocks.append(torch.where(ok, order, 0))
    return torch.cat(blocks), torch.cat(oks)


def sparse_attention_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tok_slot: torch.Tensor,
    tok_pos: torch.Tensor,
    blocks: torch.Tensor,
    ok: torch.Tensor,
    scale: float,
    ratio: int,
    fp32_products: bool = False,
) -> torch.Tensor:
    """Softmax attention of each query over its selected blocks and its tail, read from the cache.

    Args:
        q: [T, H, D] rotated queries; k_cache, v_cache: [S, NBS * c, Hkv, D] (this step's keys already written).
        tok_slot, tok_pos: int64 [T]; blocks, ok: [T, kb] from `select_blocks_cached`.
        fp32_products: eager (ignored when traced: a compiled step sums in fp32 already), the two products on
            fp32 copies of their (bf16 / fp16) operands, rounded back once, for a CPU without the dtype's GEMM
            instructions (`model.fused.upcasts`): there a bf16 `bmm` of these small per-query matrices loops over
            the batch with emulated kernels (a 16 x 32-token bf16 prefill of the `vs_llamacpp.py` config spent ~28
            of its ~200 ms in them; 200 -> 181 ms with the copies). The function of the low-precision GEMM (fp32
            sums, one rounding), the sums in another order.

    Returns:
        [T, H, D] in q's dtype (softmax in fp32).
    """
    T, H, D = q.shape
    S, Lc, Hkv, _ = k_cache.shape
    c = ratio
    NBS = Lc // c
    G = H // Hkv
    if T == 0:
        return q.new_zeros(0, H, D)
    k_rows = k_cache.view(S * NBS, c, Hkv, D)
    v_rows = v_cache.view(S * NBS, c, Hkv, D)
    tail_blk = (tok_pos + 1) // c
    rows = tok_slot[:, None] * NBS + torch.cat([blocks, tail_blk[:, None]], dim=1)  # [T, nb]
    nb = rows.shape[1]
    j = torch.arange(c, device=q.device)
    tail_ok = j[None, :] < ((tok_pos + 1) % c)[:, None]
    mask = torch.cat([ok[:, :, None].expand(-1, -1, c).reshape(T, -1), tail_ok], dim=1)  # [T, nb * c]
    step = max(1, GATHER_BUDGET // (nb * c * Hkv * D))
    traced = torch.compiler.is_dynamo_compiling()
    outs = []
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        Tq = t1 - t0
        idx = rows[t0:t1].flatten()
        ks = k_rows.index_select(0, idx).view(Tq, nb * c, Hkv, D).transpose(1, 2)  # [Tq, Hkv, n, D]
        vs = v_rows.index_select(0, idx).view(Tq, nb * c, Hkv, D).transpose(1, 2)  # [Tq, Hkv, n, D]
        qs = q[t0:t1].view(Tq, Hkv, G, D)
        mm = _summed_matmul if traced else _fp32_matmul if fp32_products else torch.matmul  # traced: a decode step
        if fp32_products and not traced:  # contiguous fp32 copies: the batch flattens, the keys' transpose the GEMM's
            ks, vs = _fp32(ks), _fp32(vs)
        w = (mm(qs, ks.transpose(-1, -2)) * scale).masked_fill(~mask[t0:t1, None, None, :], float("-inf"))
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        outs.append(mm(w, vs).reshape(Tq, H, D))
    return torch.cat(outs)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32, memory_format=torch.contiguous_format)


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)` on fp32 operands, rounded to a's dtype (`sparse_attention_cached`'s `fp32_products`)."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


def _summed_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)` ([..., M, K] @ [..., K, N]) as a broadcast product summed over K in (at least) fp32, in
    a's dtype, for inductor: in a compiled decode step the gathers of the selected rows then fuse into the reduction
    loops (no gathered keys/values in memory) and bf16 skips oneDNN's batched GEMM, whose fixed cost dominated these
    tiny products (a bf16 batch-1 step's `bmm`s were ~7% of it). The same sums as the GEMM (fp32 accumulation, one
    rounding), in another order."""
    acc = torch.promote_types(a.dtype, torch.float32)
    return (a.to(acc)[..., :, :, None] * b.to(acc)[..., None, :, :]).sum(-2).to(a.dtype)
