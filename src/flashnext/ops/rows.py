"""Row gathers and scatters whose backward is a plain gather or copy: CPU-fast twins of `index_select`.

On CPU, the backward of `index_select` is `index_add_` into zeros, which torch runs as a `scatter_add_` over an
expanded index. Profiled on the benchmark config (fwd+bwd, 1024 tokens) that took 15% of the step: ~100x slower
than a gather of the same bytes when indices repeat (QSA's selected blocks) or the incoming gradient is not
contiguous (the delta rule's chunk layout). The kernels here know more about their index than `index_select`
does, and use it:

- `scatter_rows` / `gather_rows`: the index is injective (a slot layout, a permutation), so the backward is a
  `index_select` or an `index_copy_` (a copy per row, no accumulation);
- `RepeatedGather`: rows are gathered many times with one index shared by several tensors (QSA's keys and values
  of every kv head); the backward sorts the index once and sums each row's gradients as contiguous segments
  (`segment_reduce`, accumulated in fp32).

Each equals `index_select` (forward bitwise; backward to fp32 rounding of the sums' order), held together in
`tests/ops/test_rows.py`.

Legend: R rows of the source, M gathered rows, `*` trailing dims.
"""

from __future__ import annotations

import torch


class _ScatterRows(torch.autograd.Function):
    """out [n, *] = zeros with `out[index[i]] = x[i]`; index injective (x [M, *], index int64 [M])."""

    @staticmethod
    def forward(ctx, x, index, n):
        ctx.save_for_backward(index)
        return x.new_zeros(n, *x.shape[1:]).index_copy_(0, index, x)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _GatherRows(torch.autograd.Function):
    """out [M, *] = x[index]; index injective (x [R, *]): the backward copies rows back, no accumulation."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return _ScatterRows.apply(grad.contiguous(), index, ctx.rows), None


def scatter_rows(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Rows of x [M, *] placed at distinct rows `index` (int64 [M]) of a zero [n, *] tensor.

    The backward is `grad.index_select(0, index)`. Twin: `x.new_zeros(n, *).index_copy(0, index, x)`.
    """
    return _ScatterRows.apply(x, index, n)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x.index_select(0, index)` for an index without repeats (x [R, *], index int64 [M], M <= R).

    The backward copies each gradient row to its source row (`index_copy_` into zeros) instead of `index_add_`.
    """
    return _GatherRows.apply(x, index)


class RepeatedGather:
    """Gathers of rows by one index with repeats, shared by several same-shaped tensors (a QSA query chunk's blocks).

    The index is sorted once here; every `gather(x)` then returns `x.index_select(0, index)` whose backward sums
    each source row's gradients as one contiguous segment (gradients permuted into sorted order, then
    `segment_reduce`), in fp32 for low-precision inputs.

    Args:
        index: int64 [M], rows to gather (may repeat).
        rows: R, the number of rows of the tensors gathered from.
    """

    def __init__(self, index: torch.Tensor, rows: int):
        self.index = index
        self.rows = rows
        self.order = torch.argsort(index, stable=True)
        self.counts = torch.bincount(index, minlength=rows)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, *] -> x[index] [M, *]."""
        return _GatherRepeated.apply(x, self)


class _GatherRepeated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RepeatedGather):
        ctx.plan = plan
        return x.index_select(0, plan.index)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        acc = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
        sorted_grad = acc.reshape(acc.shape[0], -1).index_select(0, plan.order)
        summed = torch.segment_reduce(sorted_grad, "sum", lengths=plan.counts, axis=0)
        return summed.view(plan.rows, *grad.shape[1:]).to(grad.dtype), None
