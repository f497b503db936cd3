"""The norms' low-precision autograd functions (`model.norm`, bf16 training) against the plain compositions.

The functions compute in fp32 or wider from the input's dtype, so run in float64 they are the same function as
the modules' composition in float64: values and gradients agree to 1e-10 (reassociation only). In bf16 the
forward runs the composition's op sequence (bitwise equal); the gradients take a different fp32 path than autograd
through the composition and are rounded once to bf16, so they agree within a few bf16 roundings (2^-6 of the
largest entry, relative; bf16's step is 2^-8).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashnext.model.norm import GatedRMSNorm, RMSNorm, gated_rms_norm_low_precision, rms_norm_low_precision


def _wide(t):  # the modules' `.float()`, kept float64 for the float64 comparisons
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rms_plain(x, weight, size, eps):
    h = F.rms_norm(_wide(x).unflatten(-1, (-1, size)), (size,), eps=eps).flatten(-2)
    return (h * (1.0 + _wide(weight))).type_as(x)


def _gated_plain(x, gate, weight, eps, activation):
    h = weight * F.rms_norm(_wide(x), (x.shape[-1],), eps=eps).to(x.dtype)
    act = F.silu if activation == "silu" else torch.sigmoid
    return (h * act(_wide(gate))).to(x.dtype)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def _grads(fn, inputs, out_grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    y.backward(out_grad)
    return y.detach(), [t.grad for t in leaves]


def _rms_case(dtype, group):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 3 * 16, generator=g, dtype=torch.float64)).to(dtype)
    w = (0.5 * torch.randn(3 * 16, generator=g, dtype=torch.float64)).to(dtype)
    return x, w, (16 if group else 48), torch.randn(37, 48, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("group", [True, False])
def test_rms_norm_function_matches_composition_fp64(group):
    x, w, size, dy = _rms_case(torch.float64, group)
    y1, (dx1, dw1) = _grads(lambda a, b: rms_norm_low_precision(a, b, size, 1e-6), (x, w), dy)
    y0, (dx0, dw0) = _grads(lambda a, b: _rms_plain(a, b, size, 1e-6), (x, w), dy)
    assert _rel(y1, y0) < 1e-12
    assert _rel(dx1, dx0) < 1e-10 and _rel(dw1, dw0) < 1e-10


@pytest.mark.parametrize("group", [True, False])
def test_rms_norm_module_bf16_matches_composition(group):
    x, w, size, dy = _rms_case(torch.bfloat16, group)
    norm = RMSNorm(48, group_size=size if group else None).to(torch.bfloat16)
    norm.weight.data.copy_(w)
    y1, (dx1,) = _grads(norm, (x,), dy)
    dw1 = norm.weight.grad
    assert y1.dtype == torch.bfloat16
    y0, (dx0, dw0) = _grads(lambda a, b: _rms_plain(a, b, size, norm.eps), (x, w), dy)
    assert torch.equal(y1, y0)  # the same forward ops
    assert _rel(dx1, dx0) < 2**-6 and _rel(dw1, dw0) < 2**-6


def _gated_case(dtype):
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(29, 3, 16, generator=g, dtype=torch.float64)).to(dtype)
    z = (2 * torch.randn(29, 3, 16, generator=g, dtype=torch.float64)).to(dtype)
    w = (1 + 0.5 * torch.randn(16, generator=g, dtype=torch.float64)).to(dtype)
    return x, z, w, torch.randn(29, 3, 16, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_function_matches_composition_fp64(activation):
    x, z, w, dy = _gated_case(torch.float64)
    y1, g1 = _grads(lambda a, b, c: gated_rms_norm_low_precision(a, b, c, 1e-6, activation), (x, z, w), dy)
    y0, g0 = _grads(lambda a, b, c: _gated_plain(a, b, c, 1e-6, activation), (x, z, w), dy)
    assert _rel(y1, y0) < 1e-12
    for a, b in zip(g1, g0, strict=True):
        assert _rel(a, b) < 1e-10


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_rms_norm_module_bf16_matches_composition(activation):
    x, z, w, dy = _gated_case(torch.bfloat16)
    norm = GatedRMSNorm(16, activation=activation).to(torch.bfloat16)
    norm.weight.data.copy_(w)
    y1, (dx1, dz1) = _grads(norm, (x, z), dy)
    dw1 = norm.weight.grad
    y0, (dx0, dz0, dw0) = _grads(lambda a, b, c: _gated_plain(a, b, c, norm.eps, activation), (x, z, w), dy)
    assert torch.equal(y1, y0)
    for a, b in ((dx1, dx0), (dz1, dz0), (dw1, dw0)):
        assert a.dtype == torch.bfloat16 and _rel(a, b) < 2**-6


def test_fp32_and_no_grad_keep_the_composition():
    """fp32 training keeps the plain composition (held to transformers by tests/reference); so does bf16 without
    grad (serving)."""
    x, w, size, _ = _rms_case(torch.float32, True)
    norm = RMSNorm(48, group_size=size)
    norm.weight.data.copy_(w)
    xg = x.clone().requires_grad_(True)
    assert type(norm(xg).grad_fn).__name__ == "MulBackward0"  # the composition's last op
    xb = x.bfloat16().requires_grad_(True)
    assert "_RMSNormFn" in type(norm.bfloat16()(xb).grad_fn).__name__
    with torch.no_grad():
        assert torch.equal(norm(xb), _rms_plain(xb, norm.weight, size, norm.eps))
