"""The int8 trunk modules (`quant.int_linear`) against their dequantise-then-matmul twin.

Tolerance: the kernel multiplies bf16 activations by int8 weights and rounds its output to bf16, the twin computes
in fp32 from the same bf16-rounded input, so they differ by the output's bf16 rounding plus accumulation order:
relative 1e-2 of the output's scale (bf16 has 8 mantissa bits: 2^-8 = 3.9e-3 per rounding).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from flashnext.model.fused import Group, apply_linear
from flashnext.quant import int_linear
from flashnext.quant.int_linear import (
    Int8Group,
    Int8Linear,
    dequantize_int8,
    int8_linear,
    int8_linear_ref,
    quantize_int8,
)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().clamp_min(1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= 1e-2 * scale, f"max error {err:.3g} against output scale {scale:.3g}"


def test_quantize_int8_rounds_to_half_a_step():
    w = torch.randn(37, 70) * torch.linspace(0.01, 3, 37)[:, None]
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s) - w).abs()
    assert bool((err <= s.float()[:, None] * 0.5 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64, 96), (16, 64, 1), (5, 256, 33), (3, 4, 32, 48), (2, 8, 5)], ids=str)
def test_int8_linear_matches_reference(dtype, shape):
    *lead, K, N = shape
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen).to(dtype)
    x = torch.randn(*lead, K, generator=gen).to(dtype)
    q, s = quantize_int8(w)
    got, want = int8_linear(x, q, s, b), int8_linear_ref(x, q, s, b)
    assert got.dtype == dtype and got.shape == (*lead, N)
    _close(got, want)


def test_int8_linear_module_replaces_linear_on_both_paths():
    lin = nn.Linear(48, 20, bias=True)
    mod = Int8Linear.from_float(lin.weight.detach(), lin.bias.detach())
    x = torch.randn(6, 48)
    want = int8_linear_ref(x, mod.qweight, mod.scale, mod.bias)
    _close(mod(x), want)
    _close(apply_linear(mod, x, fused=True), want)  # the serving call of a projection
    _close(mod(x), lin(x))  # and close to the float layer (int8 error ~ 1/127 of a row's largest weight)


def test_int8_group_is_its_members_and_sees_their_requantization():
    a, b, c = nn.Linear(32, 24, bias=False), nn.Linear(32, 8, bias=False), nn.Linear(32, 1, bias=False)
    group, members = Int8Group.from_group(Group(a, b, c))
    x = torch.randn(4, 32)
    outs = group(x, fused=True)
    for out, m in zip(outs, members, strict=True):
        _close(out, int8_linear_ref(x, m.qweight, m.scale))
    new = torch.randn(8, 32) * 5
    members[1].write_rows(0, new)  # a weight update of one member, in place
    q, s = quantize_int8(new)
    assert torch.equal(group.qweight[24:32], q) and torch.equal(group.scale[24:32], s)
    _close(group(x)[1], int8_linear_ref(x, q, s))
    assert group.refresh() is False  # nothing to rebuild: the members are row views of the group


def _traced_ops(fn, *args):
    """fn compiled by dynamo without code generation (aot_eager's graph run eagerly): (output, the traced ops)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return out, {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_few_row_int8_product_is_a_reduction_over_the_codes(dtype):
    """Inside a compiled graph an int8 product of fp32 activations of at most `int_linear.REDUCED_ROWS` rows is an
    fp32 reduction over the upcast codes with the row scale applied to the sums (`fused.reduced_linear`), no packed
    kernel; more rows, and bf16 activations, keep `_weight_int8pack_mm`. The reduction is the fp32 twin on the
    unrounded input up to the order of fp32 sums (1e-4 of the output's scale, against ~3e-3 for the kernel's bf16
    input and output: this tells the paths apart). Also through an `Int8Group` (the fused projections)."""
    gen = torch.Generator().manual_seed(0)
    q, s = quantize_int8(torch.randn(96, 256, generator=gen))
    b = torch.randn(96, generator=gen).to(dtype)
    for rows in (1, 3, int_linear.REDUCED_ROWS, int_linear.REDUCED_ROWS + 1):
        x = torch.randn(rows, 256, generator=gen).to(dtype)
        got, ops = _traced_ops(lambda x: int8_linear(x, q, s, b), x)
        reduced = rows <= int_linear.REDUCED_ROWS and dtype == torch.float32
        assert reduced == ("aten._weight_int8pack_mm" not in ops) and reduced == any("sum" in op for op in ops), ops
        assert got.dtype == dtype and got.shape == (rows, 96)
        want = int8_linear_ref(x, q, s, b, exact_input=reduced)
        if reduced and dtype == torch.float32:
            err = (got - want).abs().max()
            assert err <= 1e-4 * want.abs().max(), f"max error {err:.3g}"
            assert (int8_linear(x, q, s, b) - want).abs().max() > 1e-4 * want.abs().max()  # the kernel's bf16
        else:
            _close(got, want)
    a, c = nn.Linear(256, 40, bias=False), nn.Linear(256, 24, bias=True)
    group, members = Int8Group.from_group(Group(a, c))
    x = torch.randn(2, 256, generator=gen)
    (ya, yc), ops = _traced_ops(lambda x: group(x, fused=True), x)
    assert "aten._weight_int8pack_mm" not in ops, ops
    for y, m in zip((ya, yc), members, strict=True):
        want = int8_linear_ref(x, m.qweight, m.scale, m.bias, exact_input=True)
        assert (y - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.slow
def test_reduced_int8_product_is_one_loop_over_the_codes_under_inductor():
    """The generated code (inductor) of a one-row int8 product: the codes read as int8 inside the reduction (a
    vectorised int8 load converted to fp32), no packed kernel call, no buffer the size of the weight (no
    dequantised temporary); equal to the fp32 twin up to the order of fp32 sums. Also at `REDUCED_ROWS` rows."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(1)
    q, s = quantize_int8(torch.randn(300, 256, generator=gen))
    b = torch.randn(300, generator=gen)
    compiled = torch.compile(lambda x: int8_linear(x, q, s, b), fullgraph=True, dynamic=False)
    for rows in (1, int_linear.REDUCED_ROWS):
        x = torch.randn(rows, 256, generator=gen)
        with torch.no_grad():
            got, (code,) = run_and_get_code(compiled, x)
        want = int8_linear_ref(x, q, s, b, exact_input=True)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        assert "_weight_int8pack_mm" not in code
        assert "Vectorized<int8_t>::loadu" in code  # the codes streamed as int8 by the reduction loop
        sizes = [eval(m) for m in re.findall(r"empty_strided_cpu\((\([^)]*\))", code)]
        assert all(math.prod(size) < q.numel() for size in sizes), sizes
