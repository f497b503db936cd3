"""Block-FP8 routed experts (`model/quant_experts_fp8.py`) against their reference twin, and the block format
(`ops/fp8_blocks.py`)."""

from __future__ import annotations

import pytest
import torch

from flashnext.model.quant_experts_fp8 import Fp8Experts, reference_experts, use_fp8_experts
from flashnext.model.state import DECODE, TRAIN_STEP, Step
from flashnext.ops.fp8_blocks import FP8_DTYPE, dequantize_blocks, quantize_blocks

E, D, I = 8, 256, 192  # I = 192: gate/up grids [2, 2] with a partial last block row; down [2, 2]


def _fp8_experts(dtype=torch.float32, seed=0) -> Fp8Experts:
    gen = torch.Generator().manual_seed(seed)
    m = Fp8Experts(E, D, I, dtype=dtype)
    gi = m.gate_up_proj_scale_inv.shape[1] // 2
    for e in range(E):
        for h in range(2):  # gate, then up: separate tensors with their own grids, as on disk
            q, s = quantize_blocks(torch.randn(I, D, generator=gen) * (1 + e))
            m.gate_up_proj[e, h * I : (h + 1) * I], m.gate_up_proj_scale_inv[e, h * gi : (h + 1) * gi] = q, s
        m.down_proj[e], m.down_proj_scale_inv[e] = quantize_blocks(torch.randn(D, I, generator=gen) / (1 + e))
    return m


def test_block_quantisation_round_trip_and_paths():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen)
    w[:128, :128] = 0  # an all-zero block: scale 1, exact zeros back
    q, s = quantize_blocks(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.bfloat16 and s.shape == (3, 2) and s[0, 0] == 1
    back = dequantize_blocks(q, s, torch.float32)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; below them half the smallest
    # subnormal step (2^-10) times the block's scale. The bf16-rounded scale can clamp the block max by <= 2^-8.
    scale = s.float().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, scale * 2**-10)).all()
    assert torch.equal(back[:128, :128], torch.zeros(128, 128))
    # The block-view path (whole blocks) and the expanded-scale path form the same fp32 products.
    q2, s2 = quantize_blocks(torch.randn(256, 128, generator=gen))
    expanded = q2.float() * s2.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(dequantize_blocks(q2, s2, torch.float32), expanded)
    assert torch.equal(dequantize_blocks(q2, s2, torch.bfloat16), expanded.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "k", "static"), [(1, 2, False), (4, 2, False), (40, 3, False), (16, 2, True)])
def test_fp8_experts_match_the_dequantised_twin(dtype, tokens, k, static):
    fp8 = _fp8_experts(dtype)
    ref = reference_experts(fp8)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, D, generator=gen).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen).to(dtype)
    with torch.no_grad():
        step = Step(DECODE, static=True) if static else TRAIN_STEP
        ours, want = fp8(x, experts, weights, step), ref(x, experts, weights, step)
    assert ours.dtype == dtype
    # Same dequantised weights (bitwise: one function), but the twin runs all E experts through other GEMM shapes
    # (grouped over E, or every expert when static), so sums may round differently: fp32 / bf16 rounding.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (ours.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def test_dequantised_experts_are_the_block_products():
    fp8 = _fp8_experts()
    gate_up, down = fp8.dequantize(torch.tensor([5, 2]))
    gi = fp8.gate_up_proj_scale_inv.shape[1] // 2
    for row, e in enumerate((5, 2)):
        s = fp8.gate_up_proj_scale_inv[e]
        assert torch.equal(gate_up[row, :I], dequantize_blocks(fp8.gate_up_proj[e, :I], s[:gi], torch.float32))
        assert torch.equal(gate_up[row, I:], dequantize_blocks(fp8.gate_up_proj[e, I:], s[gi:], torch.float32))
        assert torch.equal(down[row], dequantize_blocks(fp8.down_proj[e], fp8.down_proj_scale_inv[e], torch.float32))


def test_layers_share_one_reused_buffer_and_casts_keep_fp8():
    model = torch.nn.Module()
    with torch.device("meta"):
        from flashnext.model.moe import Experts

        model.a = Experts(type("C", (), dict(num_experts=E, hidden_size=D, moe_intermediate_size=I))())
        model.b = Experts(type("C", (), dict(num_experts=E, hidden_size=D, moe_intermediate_size=I))())
    use_fp8_experts(model, {"a": torch.bfloat16, "b": torch.bfloat16}, torch.float32)
    model.to_empty(device="cpu")
    assert model.a.scratch is model.b.scratch and model.a.gate_up_proj.dtype == FP8_DTYPE
    model.to(torch.bfloat16)  # a model-wide cast changes the compute dtype only
    assert model.a.gate_up_proj.dtype == FP8_DTYPE and model.a.down_proj_scale_inv.dtype == torch.bfloat16
    assert model.a.dtype == torch.bfloat16
    for m in (model.a, model.b):
        m.gate_up_proj.zero_(), m.down_proj.zero_()
    x, w = torch.randn(3, D).bfloat16(), torch.ones(3, 2).bfloat16()
    with torch.no_grad():
        model.a(x, torch.tensor([[0, 1], [2, 3], [0, 4]]), w)
        held = {t.data_ptr() for pair in model.a.scratch._bufs.values() for t in pair}
        model.b(x, torch.tensor([[7, 1], [2, 3], [7, 4]]), w)  # as many experts: the same buffer, not a new one
        assert {t.data_ptr() for pair in model.b.scratch._bufs.values() for t in pair} == held
    # FP8 weights, bf16 grids [4, 2] (gate + up) and [2, 2] (down)
    assert model.a.nbytes == E * (2 * I * D + D * I) + E * (4 * 2 + 2 * 2) * 2
