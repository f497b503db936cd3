"""Inference-time fused projections: linears that read the same input, computed as one matmul.

Serving runs with autograd off; there a group of `nn.Linear`s over one input (a layer's q/k/v/indexer projections,
the MoE router and shared-expert projections, ...) costs one GEMM over their concatenated weights instead of one
small GEMM each. The concatenated weight is built on first use and rebuilt whenever a member's weight changes
(its storage or its in-place version counter: an optimizer step, `load_state_dict`, a weight sync from the
trainer), so it never serves stale weights. With autograd on (training) every linear runs on its own, unchanged.

Skinny inputs (a decode step: a few rows) multiply as `W @ x.T`: MKL splits the long weight dimension across
threads, which on this CPU made e.g. the 16-row x 16384-vocab LM head ~2x faster than `x @ W.T`.

Legend: M rows of input, K input features, N output features (summed over the group).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_ROWS = 64  # inputs with at most this many rows use `W @ x.T`

# first module of a group -> (its members' parameters, their stamp, fused weight, fused bias, split sizes)
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def active(x: torch.Tensor) -> bool:
    """Whether the fused paths apply to input `x`: autograd off and real (not meta) data."""
    return not torch.is_grad_enabled() and x.device.type != "meta"


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, contiguous: bool = True
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, as `(weight @ x.T).T` for 2-D inputs of at most `SKINNY_ROWS` rows.

    `contiguous=False` may return that transposed view as is (for a consumer that reduces rows anyway, e.g. the
    LM head's logits going to argmax/log-softmax: the copy of a 16 x 16384 result cost more than the argmax).
    """
    if not active(x) or x.device.type != "cpu" or x.dim() != 2 or x.shape[0] > SKINNY_ROWS:
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t()
    if bias is not None:
        y = y + bias
    return y.contiguous() if contiguous else y


def _bias(m: nn.Module) -> torch.Tensor | None:
    return getattr(m, "bias", None)


def _fused(linears: tuple[nn.Module, ...]):
    params = [m._parameters.get(name) for m in linears for name in ("weight", "bias")]
    hit = _FUSED.get(linears[0])
    if hit is not None:
        cached, stamp, weight, bias, sizes = hit
        if all(a is b for a, b in zip(params, cached, strict=True)) and stamp == _stamp(params):
            return weight, bias, sizes
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears]).detach()
        bias = None
        if any(_bias(m) is not None for m in linears):
            bias = torch.cat(
                [_bias(m) if _bias(m) is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
            ).detach()
    sizes = [m.weight.shape[0] for m in linears]
    _FUSED[linears[0]] = (params, _stamp(params), weight, bias, sizes)
    return weight, bias, sizes


def _stamp(params: list) -> tuple:
    """What identifies a parameter's values: its storage and its in-place version counter."""
    return tuple((p.data_ptr(), p._version) for p in params if p is not None)


def project(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, m.weight, m.bias)` for every module (an `nn.Linear`, or any module with a 2-D `weight`
    and optional `bias`); with autograd off, one matmul over the group's concatenated weights."""
    if not active(x):
        return tuple(m(x) if isinstance(m, nn.Linear) else F.linear(x, m.weight, _bias(m)) for m in linears)
    weight, bias, sizes = _fused(linears)
    return torch.split(linear(x, weight, bias), sizes, dim=-1)
