"""QSA sparse attention, vectorised over queries: no per-query or per-sequence Python loop.

Queries are processed in chunks that bound memory; a chunk scores only the blocks its sequences can see, keeps the
top `block_topk` (ties: higher score, then later block — see `ops.qsa_ref`), and attends over the gathered
`block_topk * c + c - 1` candidate tokens, never a dense T x T mask.

`pool_blocks` (a block's key before its norm) and `rank_blocks` (score, tie rule, top-k) are the pieces serving
shares with training: `ops.qsa_cached` selects from the cache's block keys with the same `rank_blocks`.

Legend: T tokens, Tq queries in a chunk, Hi/Di indexer heads/dim, NB blocks, n selected slots, H/Hkv/D attention.
"""

from __future__ import annotations

import bisect
import math

import torch

from flashnext.batch import Segments

SCORE_BUDGET = 1 << 22  # elements of the [Tq, Hi, NB] score tensor per chunk (16 MiB fp32: memory gets reused)
GATHER_BUDGET = 1 << 21  # elements of one head's gathered [Tq, n, D] keys per chunk (8 MiB fp32)


def complete_blocks(seg: Segments, ratio: int) -> torch.Tensor:
    """int64 [NB]: flat index of the first token of every complete c-token block, in stream order.

    Built from the host lengths, so it needs no device sync and works on the meta device.
    """
    starts = [a + j * ratio for a, n in zip(seg.cu_host[:-1], seg.lengths, strict=True) for j in range(n // ratio)]
    return torch.tensor(starts, dtype=torch.long).to(seg.seq_idx.device)


def pool_blocks(raw_blocks: torch.Tensor) -> torch.Tensor:
    """Mean (in fp32, cast back) of each block's raw indexer keys. raw_blocks: [NB, c, Di] -> [NB, Di].

    Training pools blocks of the stream, serving pools the cache rows of a block when it completes: both here.
    """
    return raw_blocks.float().mean(1).to(raw_blocks.dtype)


def block_rows(block_start: torch.Tensor, ratio: int) -> torch.Tensor:
    """int64 [NB, c]: the flat token index of every token of each block (from `complete_blocks`)."""
    return block_start[:, None] + torch.arange(ratio, device=block_start.device)


@torch.no_grad()
def rank_blocks(
    idx_q: torch.Tensor, block_keys: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top `k` visible blocks of every query: the one QSA selection rule, for training and serving.

    Score of a block = sum_h relu(q_h . key) / sqrt(Di). Tie rule as one integer key: the fp32 bits of a score
    >= 0 order like the score itself, so (bits << 32) + block index ranks by score, then by the later block;
    invisible blocks get -1 (`+ 0.0` turns a -0.0 from relu into +0.0, whose bits are 0).

    Args:
        idx_q: [Tq, Hi, Di] normalised, rotated indexer queries.
        block_keys: [NB, Di] keys shared by every query, or [Tq, NB, Di] per query.
        visible: bool [Tq, NB], the blocks each query may select.
        k: blocks to keep (<= NB).

    Returns:
        order int64 [Tq, k] (block index within `block_keys`, by rank) and ok bool [Tq, k] (a visible block).
    """
    Di = idx_q.shape[-1]
    spec = "thd,bd->thb" if block_keys.dim() == 2 else "thd,tbd->thb"
    scores = torch.einsum(spec, idx_q.float(), block_keys.float()).relu().sum(1) / math.sqrt(Di)
    bits = (scores + 0.0).view(torch.int32).long()
    index = torch.arange(visible.shape[1], device=visible.device)
    key = torch.where(visible, (bits << 32) + index, -1)
    vals, order = torch.topk(key, k, dim=-1)
    return order, vals >= 0


@torch.no_grad()
def select_tokens(
    idx_q: torch.Tensor,
    block_keys: torch.Tensor,
    block_start: torch.Tensor,
    seg: Segments,
    ratio: int,
    block_topk: int,
    q_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token indices each query attends to.

    Args:
        idx_q: [T, Hi, Di]; block_keys: [NB, Di]; block_start: int64 [NB] (from `complete_blocks`).
        seg, block_keys, block_start: describe the stream the keys come from; the queries are its rows
            `q_offset .. q_offset + T - 1` (context parallelism: a rank's queries against the whole stream).

    Returns:
        sel [T, n] int64 flat token indices of the stream (0 where unused) and ok [T, n] bool,
        n = block_topk*ratio + ratio - 1.
    """
    T, Hi, _ = idx_q.shape
    n = block_topk * ratio + ratio - 1
    device = idx_q.device
    sel = torch.zeros(T, n, dtype=torch.long, device=device)
    ok = torch.zeros(T, n, dtype=torch.bool, device=device)
    NB = block_start.numel()
    step = max(1, SCORE_BUDGET // max(1, Hi * NB))
    arange_c = torch.arange(ratio, device=device)
    cu = seg.cu_host
    blocks_before = [0]  # complete blocks in sequences 0..n-1
    for length in seg.lengths:
        blocks_before.append(blocks_before[-1] + length // ratio)
    for q0 in range(0, T, step):
        q1 = min(T, q0 + step)
        t0, t1 = q0 + q_offset, q1 + q_offset  # the chunk's rows in the stream
        t = torch.arange(t0, t1, device=device)
        s = seg.seq_start[t0:t1]
        # The chunk sees blocks from its first query's sequence start up to those complete by t1 (host math).
        first, last = bisect.bisect_right(cu, t0) - 1, bisect.bisect_right(cu, t1 - 1) - 1
        b_lo = blocks_before[first]
        b_hi = blocks_before[last] + min(seg.lengths[last], t1 - cu[last]) // ratio
        k_blocks = min(block_topk, b_hi - b_lo)
        if k_blocks > 0:
            starts = block_start[b_lo:b_hi]
            visible = (starts[None, :] >= s[:, None]) & (starts[None, :] + ratio <= t[:, None] + 1)
            order, top_ok = rank_blocks(idx_q[q0:q1], block_keys[b_lo:b_hi], visible, k_blocks)
            top = starts[order]  # [Tq, k]
            width = k_blocks * ratio
            sel[q0:q1, :width] = (top[:, :, None] + arange_c).flatten(1)
            ok[q0:q1, :width] = top_ok[:, :, None].expand(-1, -1, ratio).flatten(1)
        # Tail: the incomplete block ending at the query.
        tail_len = (t - s + 1) % ratio
        j = torch.arange(ratio - 1, device=device)
        tail = (t - tail_len + 1)[:, None] + j
        sel[q0:q1, n - (ratio - 1) :] = torch.where(j < tail_len[:, None], tail, 0)
        ok[q0:q1, n - (ratio - 1) :] = j < tail_len[:, None]
    return sel, ok


class _Scores(torch.autograd.Function):
    """`q @ keys^T` for q [b, G, D], keys [b, n, D] (G = query heads per kv head, small).

    CPU `bmm` falls back to a per-batch loop for some layouts (a non-contiguous batch stride, or a contiguous
    operand whose inner dim is the small G), so the backward picks the fast layouts explicitly: a contiguous
    incoming gradient, and `grad^T` as a transposed view rather than a copy.
    """

    @staticmethod
    def forward(ctx, q, keys):
        ctx.save_for_backward(q, keys)
        return torch.bmm(q, keys.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        q, keys = ctx.saved_tensors
        grad = grad.contiguous()
        return torch.bmm(grad, keys), torch.bmm(grad.transpose(1, 2), q)


class _Mix(torch.autograd.Function):
    """`p @ values` for p [b, G, n], values [b, n, D], with the backward layouts chosen as in `_Scores`."""

    @staticmethod
    def forward(ctx, p, values):
        ctx.save_for_backward(p, values)
        return torch.bmm(p, values)

    @staticmethod
    def backward(ctx, grad):
        p, values = ctx.saved_tensors
        grad = grad.contiguous()
        return torch.bmm(grad, values.transpose(1, 2)), torch.bmm(p.transpose(1, 2), grad)


def aligned_slots(seg: Segments, ratio: int) -> tuple[torch.Tensor, int]:
    """Block-aligned layout: each sequence padded to whole c-token blocks, so block b of a sequence is one row.

    Returns:
        slot int64 [T] (token -> row * c + offset in the padded layout) and the number of rows, from host lengths.
    """
    rows, base = 0, []
    for length in seg.lengths:
        base.append(rows)
        rows += -(-length // ratio)
    base_t = torch.tensor(base, dtype=torch.long).to(seg.seq_idx.device)
    pos = seg.pos_in_seq
    return base_t[seg.seq_idx] * ratio + pos, rows


# Opaque to torch.compile (runs eagerly between graphs, with its own autograd): the block-aligned layout's row
# count and the chunk loop come from host lengths, which a traced graph would specialise on.
@torch.compiler.disable
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sel: torch.Tensor,
    ok: torch.Tensor,
    scale: float,
    seg: Segments,
    ratio: int,
) -> torch.Tensor:
    """Softmax attention of each query over its selected tokens, per key/value head and query chunk.

    The selection is whole blocks plus the tail, and both start at block boundaries of the query's sequence, so
    keys/values are laid out block-aligned (`aligned_slots`) and gathered a block (c x D) per row: a quarter of
    the rows of a token-wise gather. Each (kv head, chunk) is then two 3-D `bmm`s on contiguous operands. Query
    chunks are `split` views (backward: one `cat`), small enough for the allocator to reuse their memory.

    Args:
        q: [T, H, D]; k, v: [Tk, Hkv, D]; sel/ok: [T, n] from `select_tokens` (n = k_blocks * c + c - 1).
        seg: the segments of the key/value stream (Tk tokens; the queries are T of its rows, all of them unless
            a context-parallel rank passes its own queries against every rank's keys); ratio: c, the block size.

    Returns:
        [T, H, D] in q's dtype (softmax in fp32, as the reference's eager attention).
    """
    T, H, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    n = sel.shape[1]
    if T == 0:
        return q.new_zeros(0, H, D)
    c = ratio
    slot, rows = aligned_slots(seg, c)
    # Rows to gather: the first token of every selected block and of the tail, mapped to its aligned block.
    first = torch.cat([sel[:, : n - (c - 1) : c], sel[:, n - (c - 1) :][:, :1]], dim=1) if c > 1 else sel
    blk = slot[first] // c  # [T, kb + 1]
    nb = blk.shape[1]
    mask = torch.cat([ok, ok.new_zeros(T, nb * c - n)], dim=1)  # [T, nb * c]; the tail's c-th token never counts
    step = max(1, GATHER_BUDGET // max(1, nb * c * D))
    heads = []
    for h in range(Hkv):
        k_h = k.new_zeros(rows * c, D).index_copy(0, slot, k[:, h]).view(rows, c * D)
        v_h = v.new_zeros(rows * c, D).index_copy(0, slot, v[:, h]).view(rows, c * D)
        q_chunks = q[:, h * G : (h + 1) * G].contiguous().split(step)  # [Tq, G, D] each
        outs = []
        for i, t0 in enumerate(range(0, T, step)):
            t1 = min(T, t0 + step)
            idx = blk[t0:t1].flatten()
            ks = k_h.index_select(0, idx).view(t1 - t0, nb * c, D)
            vs = v_h.index_select(0, idx).view(t1 - t0, nb * c, D)
            w = _Scores.apply(q_chunks[i], ks) * scale  # [Tq, G, nb * c]
            w = w.masked_fill(~mask[t0:t1, None, :], float("-inf"))
            w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            outs.append(_Mix.apply(w, vs))  # [Tq, G, D]
        heads.append(torch.cat(outs))
    return torch.cat(heads, dim=1)
