"""The LM head fused with its loss, in row chunks: the full [T, V] logits are never materialised.

Training needs only a scalar (SFT cross-entropy) or one number per token (RL: the target's log-prob and the
row's entropy) from `hidden @ W^T`. Materialised, the fp32 logits of 4096 tokens over a 16,384 vocabulary are
256 MiB, written by the GEMM, read and written again by `log_softmax`, its backward and the `.float()` casts,
and freshly allocated (zero-filled pages) every step. Here each chunk of rows is a [rows, V] slab of
`CHUNK_ELEMENTS` that the allocator reuses:

- `linear_cross_entropy`: the summed CE. Its gradients are computed chunk by chunk in the forward itself (the
  loss is a sum, so `d loss / d logits = softmax - onehot` is known there) and only scaled by the incoming
  gradient in backward: no recomputation, the same three GEMMs as the plain path.
- `linear_logprobs`: the target log-probs and entropies. Their gradients depend on what the caller does with
  them (the RL loss), so the backward recomputes each chunk's logits: one extra `hidden @ W^T` GEMM.

Both compute the GEMMs in `hidden`'s dtype (bf16 under bf16 training, as the plain `lm_head` would) and the
softmax, loss and entropy in fp32, as `train.loss` does on the materialised logits. Twins: `ops.lm_head_ref`.

Legend: T rows (tokens), D hidden, V vocabulary, R rows per chunk.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 22  # fp32 logits per chunk (16 MiB): the slab the allocator reuses chunk after chunk
# Low-precision training: chunk gradients (bf16 [R, V]) gathered into one slab of this many elements (32 MiB in
# bf16) before each weight-gradient GEMM. Every such product lands in the fp32 accumulator through a cast and an
# add over all of [V, D]; one per slab instead of one per chunk (4x fewer at V = 16,384) is what bf16 pays less.
WEIGHT_GRAD_ELEMENTS = 1 << 24
IGNORE_INDEX = -100


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a vocabulary of `vocab` (at least 1)."""
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Sum over rows of `cross_entropy(hidden @ weight^T, targets)` in fp32, rows with `ignore_index` left out.

    Args:
        hidden: [T, D]; weight: [V, D] (the LM head, same dtype as hidden); targets: int64 [T].

    Returns:
        0-d fp32 sum (not a mean: the caller divides by its count).
    """
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Per row: log-softmax of `hidden @ weight^T` at `targets`, and the softmax's entropy, both fp32.

    Args:
        hidden: [T, D]; weight: [V, D]; targets: int64 [T], valid vocabulary ids.

    Returns:
        logprobs [T] and entropy [T] (both differentiable).
    """
    return _LinearLogprobs.apply(hidden, weight, targets)


def _chunks(T: int, V: int):
    rows = chunk_rows(V)
    return [(a, min(T, a + rows)) for a in range(0, T, rows)]


def _zero_rows(x: torch.Tensor, rows: torch.Tensor) -> None:
    """x[rows] = 0 in place (rows: bool [R]); on CPU only the selected rows are touched, not a full masked pass."""
    if x.device.type != "cpu":
        x.masked_fill_(rows[:, None], 0.0)  # no host sync on an accelerator
        return
    index = rows.nonzero().squeeze(1)
    if index.numel():
        x.index_fill_(0, index, 0.0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index):
        T, V = hidden.shape[0], weight.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        d_weight = d_weight if ctx.needs_input_grad[1] else None
        # fp32 accumulates each chunk's product in place (addmm_); a low-precision product is gathered (`slab`)
        slab = None
        if d_weight is not None and hidden.dtype != torch.float32:
            rows = chunk_rows(V) * max(1, WEIGHT_GRAD_ELEMENTS // (chunk_rows(V) * V))
            slab = torch.empty(min(T, rows), V, dtype=hidden.dtype, device=hidden.device)
        start = 0  # first row of the slab
        for a, b in _chunks(T, V):
            h, t = hidden[a:b], targets[a:b]
            logp = torch.log_softmax((h @ weight.t()).float(), dim=-1)  # [R, V] fp32
            valid = t != ignore_index
            rows = torch.arange(b - a, device=logp.device)
            safe = torch.where(valid, t, 0)
            total -= torch.where(valid, logp[rows, safe], 0.0).sum()
            if d_hidden is None and d_weight is None:
                continue
            # d CE / d logits = softmax - onehot(target), zero on ignored rows: in place over the chunk's log-probs
            grad = logp.exp_()
            grad[rows, safe] -= 1.0
            _zero_rows(grad, ~valid)
            if slab is None:
                grad = grad.to(hidden.dtype)
            else:
                if b - start > slab.shape[0]:  # full: its rows' product into the fp32 accumulator
                    d_weight += slab[: a - start].t() @ hidden[start:a]
                    start = a
                grad = slab[a - start : b - start]
                grad.copy_(logp)
            if d_hidden is not None:
                torch.mm(grad, weight, out=d_hidden[a:b])
            if d_weight is not None and slab is None:
                d_weight.addmm_(grad.t(), h)
        if slab is not None and T > start:
            d_weight += slab[: T - start].t() @ hidden[start:T]  # accumulated in fp32 whatever the compute dtype
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(d_hidden, d_weight)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        d_hidden, d_weight = ctx.saved_tensors
        gh = None if d_hidden is None else d_hidden * grad_out.to(d_hidden.dtype)
        gw = None if d_weight is None else (d_weight * grad_out).to(ctx.weight_dtype)
        return gh, gw, None, None


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets):
        T, V = hidden.shape[0], weight.shape[0]
        logprobs = torch.empty(T, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse_all = torch.empty_like(logprobs)
        for a, b in _chunks(T, V):
            logits = (hidden[a:b] @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            logp = logits.sub_(lse[:, None])  # in place: [R, V] log-probs
            lse_all[a:b] = lse
            logprobs[a:b] = logp.gather(1, targets[a:b, None]).squeeze(1)
            entropy[a:b] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse_all, entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, d_logprobs, d_entropy):
        hidden, weight, targets, lse_all, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, V = hidden.shape[0], weight.shape[0]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for a, b in _chunks(T, V):
            h = hidden[a:b]
            logp = (h @ weight.t()).float().sub_(lse_all[a:b, None])  # recomputed: [R, V] log-probs
            p = logp.exp()
            # d lp / d z = onehot - p;  d H / d z = -p (log p + H)
            grad = logp.add_(entropy[a:b, None]).mul_(p).mul_(-d_entropy[a:b, None])
            grad.sub_(p.mul_(d_logprobs[a:b, None]))
            grad[torch.arange(b - a, device=grad.device), targets[a:b]] += d_logprobs[a:b]
            grad = grad.to(hidden.dtype)
            if d_hidden is not None:
                torch.mm(grad, weight, out=d_hidden[a:b])
            if d_weight is not None:
                d_weight.add_(grad.t() @ h)
        gw = None if d_weight is None else d_weight.to(weight.dtype)
        return d_hidden, gw, None
