"""RMS norms of Qwen3.8-Flash-Next."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LOW_PRECISION = (torch.bfloat16, torch.float16)  # training in these takes the fused autograd functions below


class RMSNorm(nn.Module):
    """RMSNorm scaling by `(1 + weight)` in fp32, optionally per group of `group_size` features.

    With `group_size`, a `[..., hc * D]` vector is normalised as hc separate `D`-vectors (one per stream).
    """

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = self.group_size or x.shape[-1]
        if x.dtype in LOW_PRECISION and torch.is_grad_enabled():
            return rms_norm_low_precision(x, self.weight, size, self.eps)
        h = x.float()
        h = F.rms_norm(h.unflatten(-1, (-1, size)), (size,), eps=self.eps).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain `weight` scale) followed by an activation gate: `w * norm(x) * act(gate)`."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype in LOW_PRECISION and torch.is_grad_enabled():
            return gated_rms_norm_low_precision(x, gate, self.weight, self.eps, self.activation)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        h = self.weight * h.to(dtype)
        act = F.silu if self.activation == "silu" else torch.sigmoid
        return (h * act(gate.float())).to(dtype)


# bf16 training: the norms as autograd functions, one pass of fp32 math each way from the low-precision input.
# Their forwards run the modules' own op sequence (bitwise the same values); what changes is the backward: the
# composition's autograd graph saves fp32 temporaries and walks ~16 elementwise passes plus casts per norm, these
# recompute from the bf16 input in ~10 (measured: `benchmarks/bf16_vs_fp32.py`, RESULTS.md). The fp32 path keeps
# the plain composition (the reference tests hold it to transformers). `tests/model/test_norm_fused.py` holds
# each function to its composition: fp64 values and gradients, and bf16 within one bf16 rounding.


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _wide_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 (or wider) copy of t, which the backwards below may overwrite."""
    return t.to(_wide(t.dtype), copy=True)


class _RMSNormFn(torch.autograd.Function):
    """`RMSNorm.forward` (`(1 + weight)` scale, groups of `size` features) computed in fp32 or wider."""

    @staticmethod
    def forward(ctx, x, weight, size, eps):
        wide = _wide(x.dtype)
        h = x.to(wide).unflatten(-1, (-1, size))
        y, rstd = torch.ops.aten._fused_rms_norm(h, [size], None, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.size = size
        return (y.flatten(-2) * (1.0 + weight.to(wide))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        size, wide = ctx.size, _wide(x.dtype)
        g = _wide_copy(grad).unflatten(-1, (-1, size))
        xhat = _wide_copy(x).unflatten(-1, (-1, size)).mul_(rstd)
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (g * xhat).flatten(-2).reshape(-1, weight.numel()).sum(0).to(weight.dtype)
        gw = g.mul_((1.0 + weight.to(wide)).view(-1, size))
        dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1).div_(size)
        dx = torch.addcmul(gw, xhat, dot, value=-1).mul_(rstd)
        return dx.flatten(-2).to(x.dtype), d_weight, None, None


def rms_norm_low_precision(x: torch.Tensor, weight: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """`RMSNorm.forward` of x [..., G * size] as one autograd function (fp32 math from x's dtype, result in x's)."""
    return _RMSNormFn.apply(x, weight, size, eps)


class _GatedRMSNormFn(torch.autograd.Function):
    """`GatedRMSNorm.forward`: `(w * norm(x)).to(dtype) * act(gate)`, the norm and gate in fp32 or wider."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, activation):
        dtype, wide = x.dtype, _wide(x.dtype)
        y, rstd = torch.ops.aten._fused_rms_norm(x.to(wide), [x.shape[-1]], None, eps)
        h = weight * y.to(dtype)
        gf = gate.to(wide)
        act = F.silu(gf) if activation == "silu" else torch.sigmoid(gf)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.activation = activation
        return (h * act).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, gate, weight, rstd = ctx.saved_tensors
        wide = _wide(x.dtype)
        g = _wide_copy(grad)
        gf = gate.to(wide)
        xhat = _wide_copy(x).mul_(rstd)
        w = weight.to(wide)
        if ctx.activation == "silu":
            d_gate, act = torch.ops.aten.silu_backward(g * xhat * w, gf), F.silu(gf)
        else:
            act = torch.sigmoid(gf)
            d_gate = torch.ops.aten.sigmoid_backward(g * xhat * w, act)
        d_gate = d_gate.to(gate.dtype)
        dh = g.mul_(act)
        d_weight = None
        if ctx.needs_input_grad[2]:
            d_weight = (dh * xhat).reshape(-1, weight.numel()).sum(0).to(weight.dtype)
        gw = dh.mul_(w)
        dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1).div_(x.shape[-1])
        dx = torch.addcmul(gw, xhat, dot, value=-1).mul_(rstd)
        return dx.to(x.dtype), d_gate, d_weight, None, None


def gated_rms_norm_low_precision(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, activation: str
) -> torch.Tensor:
    """`GatedRMSNorm.forward` as one autograd function (fp32 math from x's dtype, result in x's)."""
    return _GatedRMSNormFn.apply(x, gate, weight, eps, activation)
