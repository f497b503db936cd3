"""QSA written query by query: the readable spec that `ops.qsa` must equal.

For query t of a sequence starting at s: the visible tokens are s..t; they form `(t-s+1) // c` complete blocks of
c tokens plus a tail of `(t-s+1) % c` tokens. Each block's key is the normalised, rotated mean of its raw indexer
keys (computed by the caller: `block_keys`). Score of a block = sum over indexer heads of relu(q_h . key) / sqrt(d).
The query attends to the tokens of its top `block_topk` blocks plus the tail. Ties: the higher score first, then
the LATER block (a deterministic rule shared by training and serving).

Legend: T tokens, Hi indexer heads, Di indexer dim, NB blocks, H/Hkv attention heads, D head dim, c ratio.
"""

from __future__ import annotations

import math

import torch


def select_tokens_ref(
    idx_q: torch.Tensor,
    block_keys: torch.Tensor,
    block_start: torch.Tensor,
    seq_start: torch.Tensor,
    ratio: int,
    block_topk: int,
) -> list[list[int]]:
    """Selected token indices (sorted) for every query.

    Args:
        idx_q: [T, Hi, Di] indexer queries (normalised, rotated).
        block_keys: [NB, Di] keys of every complete block of the stream, in stream order.
        block_start: int64 [NB] flat index of each block's first token.
        seq_start: int64 [T] flat index of each token's sequence start.
    """
    T, _, Di = idx_q.shape
    chosen: list[list[int]] = []
    starts = block_start.tolist()
    for t in range(T):
        s = int(seq_start[t])
        n_complete = (t - s + 1) // ratio
        blocks = [b for b, b0 in enumerate(starts) if s <= b0 and b0 + ratio <= t + 1]
        assert len(blocks) == n_complete
        picked: list[int] = []
        if blocks:
            keys = block_keys[blocks].float()
            scores = (idx_q[t].float() @ keys.T).relu().sum(0) / math.sqrt(Di)
            ranked = sorted(range(len(blocks)), key=lambda i: (-float(scores[i]), -i))
            for i in ranked[:block_topk]:
                picked.extend(range(starts[blocks[i]], starts[blocks[i]] + ratio))
        picked.extend(range(s + n_complete * ratio, t + 1))
        chosen.append(sorted(picked))
    return chosen


def sparse_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chosen: list[list[int]], scale: float
) -> torch.Tensor:
    """Softmax attention of each query over its chosen tokens. q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]."""
    T, H, D = q.shape
    group = H // k.shape[1]
    out = torch.empty_like(q)
    for t in range(T):
        idx = torch.tensor(chosen[t], dtype=torch.long)
        ks = k[idx].repeat_interleave(group, dim=1)  # [n, H, D]
        vs = v[idx].repeat_interleave(group, dim=1)
        w = torch.einsum("hd,nhd->hn", q[t], ks) * scale
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out[t] = torch.einsum("hn,nhd->hd", w, vs)
    return out
