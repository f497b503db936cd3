"""The int8 / int4 routed experts (`quant.int_experts`) against their dequantise-then-matmul twin, on each path.

Tolerance: as `test_int_linear.py` (bf16 kernel output vs the fp32 twin from the same bf16 input), relative 2e-2 of
the output's scale: two products (gate/up, then down) each rounded to bf16, and the kernels' bf16 intermediate.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashnext.errors import ConfigError
from flashnext.model.moe import Experts
from flashnext.model.state import DECODE, Step
from flashnext.quant.int_experts import QuantExperts, dequantize_int4, experts_ref, pack_int4, quantize_int4


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-2) -> None:
    scale = want.float().abs().max().clamp_min(1e-6)
    err = (got.float() - want.float()).abs().max()
    assert err <= rel * scale, f"max error {err:.3g} against output scale {scale:.3g}"


def _experts(E=8, D=64, I=64, seed=0) -> Experts:
    cfg = SimpleNamespace(num_experts=E, hidden_size=D, moe_intermediate_size=I)  # what `Experts` reads
    m = Experts(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=gen) * 0.1)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=gen) * 0.1)
    return m


def _routing(T, E, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)
    return torch.randn(T, 64, generator=gen), experts, weights


def test_quantize_int4_rounds_to_half_a_step_and_packs_losslessly():
    w = torch.randn(48, 640)
    codes, sz = quantize_int4(w, 128)
    assert sz.shape == (5, 48, 2) and int(codes.min()) >= 0 and int(codes.max()) <= 15
    step = sz[..., 0].float().t().repeat_interleave(128, dim=1)  # [N, K]
    assert bool(((dequantize_int4(codes, sz) - w).abs() <= step * 0.5 + 1e-2 * step.max()).all())
    packed = pack_int4(codes)
    assert torch.equal(QuantExperts._codes(packed), codes)  # the reference reads the codes back exactly


@pytest.mark.parametrize("scheme", ["int8", "int4-32", "int4-64"])
@pytest.mark.parametrize("path", ["gathered", "dense", "grouped"])
def test_quant_experts_match_reference(scheme, path):
    """gathered: 3 assignments of 8 experts (2A < E); dense: the static step's every-expert path; grouped: the
    eager path over the hit experts."""
    name, _, g = scheme.partition("-")
    float_experts = _experts()
    q = QuantExperts.from_float(float_experts, name, int(g or 64))
    T = 3 if path == "gathered" else 10
    x, experts, weights = _routing(T, 8, 1 if path == "gathered" else 2)
    got = q(x, experts, weights, Step(DECODE, static=path == "dense"))
    _close(got, experts_ref(q, x, experts, weights))
    # Near the float experts: a weight's rounding error is up to half a step, 1/254 (int8) or 1/30 (int4) of its
    # row's (group's) range; over a dot product of Gaussian weights that is ~0.5% (int8) / ~12% (int4) of the output.
    _close(got, float_experts(x, experts, weights), rel=0.03 if name == "int8" else 0.3)


def test_int4_group_must_divide_the_expert_width():
    QuantExperts.from_float(_experts(I=640 // 10 * 2), "int4", 32)  # I = 128: fine
    with pytest.raises(ConfigError, match="one of \\[32, 64, 128\\], got 256"):
        QuantExperts("int4", 4, 2560, 640, torch.bfloat16, torch.bfloat16, 256)
    with pytest.raises(ConfigError, match="does not divide the expert input width 96"):
        QuantExperts("int4", 4, 64, 96, torch.bfloat16, torch.bfloat16, 64)
    with pytest.raises(ConfigError, match="multiples of 16: hidden 40"):
        QuantExperts("int4", 4, 40, 64, torch.bfloat16, torch.bfloat16, 32)


def test_released_down_projection_shape_runs_at_group_128():
    """The released model's expert down_proj has K = I = 640: int4 groups up to 128 fit."""
    q = QuantExperts("int4", 2, 256, 640, torch.bfloat16, torch.bfloat16, 128)
    w = torch.randn(2, 256, 640) * 0.05
    q.write_experts("down", 0, w)
    h = torch.randn(3, 640, dtype=torch.bfloat16)
    got = q._mm(h, q.down_q[1], q.down_s[1])
    _close(got, h.float() @ q.expert_weights(1)[1].t())


@pytest.mark.parametrize("path", ["gathered", "dense", "grouped"])
def test_int8_experts_narrower_than_the_packed_kernel(path):
    """An expert width of 8 (the down projection's K % 16 != 0, where torch's packed int8 kernel crashes the
    process): the products dequantise instead, and still match the twin."""
    float_experts = _experts(E=8, D=64, I=8)
    q = QuantExperts.from_float(float_experts, "int8", 64)
    T = 3 if path == "gathered" else 10
    x, experts, weights = _routing(T, 8, 1 if path == "gathered" else 2)
    got = q(x, experts, weights, Step(DECODE, static=path == "dense"))
    _close(got, experts_ref(q, x, experts, weights))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tokens", [3, 10])
def test_int8_static_step_fuses_the_dequantisation_when_compiled(backend, tokens):
    """In a compiled static step (the decode graph) int8 experts run `_reduced`: the int8 rows gathered and upcast
    inside an fp32 product of the fp32 input, no bf16 kernel. So the output is the fp32 twin's on the unrounded
    input up to the order of fp32 sums (1e-4 of the output's scale, against ~3e-3 for the bf16 kernels: this tells
    the paths apart), and the plain twin's within the kernels' tolerance. Eager, `_reduced` gives the same; 3 tokens
    x top-1 of 8 is the gather size (2A < E), 10 x top-2 the every-expert one."""
    q = QuantExperts.from_float(_experts(), "int8")
    x, experts, weights = _routing(tokens, 8, 1 if tokens == 3 else 2)
    want = experts_ref(q, x, experts, weights, exact_input=True)
    torch._dynamo.reset()
    step = torch.compile(lambda *a: q(*a, Step(DECODE, static=True)), backend=backend, fullgraph=True, dynamic=False)
    with torch.no_grad():
        fused = step(x, experts, weights)
        _close(fused, want, rel=1e-4)
        _close(fused, experts_ref(q, x, experts, weights))
        _close(q._reduced(x, experts.flatten(), weights), want, rel=1e-4)
        # eager, the static step keeps the packed kernels (the fused form would materialise [A, 2I, D] products)
        got = q(x, experts, weights, Step(DECODE, static=True))
    _close(got, want)
    assert (got - want).abs().max() > 1e-4 * want.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 10])
def test_int8_static_step_reads_the_codes_in_place_under_inductor(tokens):
    """The generated code (inductor) of `_reduced`: each assignment's int8 rows are read where they lie (an int8
    load at an address computed from the routed expert id inside the reduction loop), so no buffer holds gathered
    or dequantised expert weights (every buffer is smaller than one expert's gate/up codes), and there is no
    packed kernel call."""
    import re

    from torch._inductor.utils import run_and_get_code

    q = QuantExperts.from_float(_experts(), "int8")
    x, experts, weights = _routing(tokens, 8, 1 if tokens == 1 else 2)
    torch._dynamo.reset()
    step = torch.compile(lambda *a: q(*a, Step(DECODE, static=True)), fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, (code,) = run_and_get_code(step, x, experts, weights)
    _close(got, experts_ref(q, x, experts, weights, exact_input=True), rel=1e-4)
    assert "_weight_int8pack_mm" not in code and "Vectorized<int8_t>::loadu" in code
    sizes = [eval(m) for m in re.findall(r"empty_strided_cpu\((\([^)]*\))", code)]
    one_expert = q.gate_up_q[0].numel()
    assert all(torch.Size(s).numel() < one_expert for s in sizes), sizes
