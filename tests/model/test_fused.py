"""Serving fast paths of the model layers against their plain twins: fused projections, skinny GEMMs, MoE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe import _cfg
from torch import nn

from flashnext.model import fused
from flashnext.model.moe import Experts, Router, SparseMoE


def _linears(bias: bool) -> tuple[nn.Module, ...]:
    torch.manual_seed(0)
    mods = (nn.Linear(12, 7, bias=bias), nn.Linear(12, 1, bias=False), Router(_cfg(E=5)), nn.Linear(12, 30, bias=bias))
    mods[2].weight = nn.Parameter(torch.randn(5, 12))
    return tuple(m.double() for m in mods)


def _separate(x, mods):
    return [F.linear(x, m.weight, getattr(m, "bias", None)) for m in mods]


@pytest.mark.parametrize("rows", [1, 16, 100], ids=["one", "skinny", "wide"])
@pytest.mark.parametrize("bias", [False, True])
def test_project_equals_separate_linears(rows, bias):
    mods = _linears(bias)
    x = torch.randn(rows, 12, dtype=torch.float64)
    with torch.no_grad():
        got = fused.project(x, *mods)
    for a, b in zip(got, _separate(x, mods), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_project_with_autograd_calls_each_module():
    """Training path: every nn.Linear runs as a module call (hooks, FLOP attribution, FSDP), gradients flow."""
    mods = _linears(True)
    x = torch.randn(4, 12, dtype=torch.float64, requires_grad=True)
    calls = []
    for m in mods:
        m.register_forward_hook(lambda mod, *_: calls.append(mod))
    out = fused.project(x, *mods)
    assert calls == [m for m in mods if isinstance(m, nn.Linear)]
    for a, b in zip(out, _separate(x, mods), strict=True):
        assert torch.equal(a, b)
    sum(o.sum() for o in out).backward()
    assert all(m.weight.grad is not None for m in mods)


def test_fused_weight_follows_in_place_updates():
    """The concatenated weight is rebuilt after an optimizer step, a load_state_dict or a `.data` swap."""
    mods = _linears(True)
    x = torch.randn(3, 12, dtype=torch.float64)

    def check():
        with torch.no_grad():
            got = fused.project(x, *mods)
        for a, b in zip(got, _separate(x, mods), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    check()
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.5)
    sum(o.sum() for o in _separate(x, mods)).backward()
    opt.step()
    check()
    state = {k: torch.randn_like(v) for k, v in mods[0].state_dict().items()}
    mods[0].load_state_dict(state)
    check()
    mods[3].weight.data = torch.randn(30, 12, dtype=torch.float64)
    check()
    mods[1].weight = nn.Parameter(torch.randn(1, 12, dtype=torch.float64))  # a new Parameter object
    check()


@pytest.mark.parametrize("contiguous", [True, False])
def test_skinny_linear_equals_f_linear(contiguous):
    w, b = torch.randn(300, 40, dtype=torch.float64), torch.randn(300, dtype=torch.float64)
    for rows in (1, 5, fused.SKINNY_ROWS, fused.SKINNY_ROWS + 1):
        x = torch.randn(rows, 40, dtype=torch.float64)
        with torch.no_grad():
            got = fused.linear(x, w, b, contiguous=contiguous)
        assert got.is_contiguous() or not contiguous
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [1, 3, 40])
def test_moe_serving_path_equals_training_path(T):
    """SparseMoE without autograd (fused router/shared projections, transposed expert GEMMs) == with autograd."""
    torch.manual_seed(3)
    moe = SparseMoE(_cfg(E=6, k=2)).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(T, 8, dtype=torch.float64)
    with torch.no_grad():
        out, experts = moe(x)
    ref, ref_experts = moe(x.clone().requires_grad_())
    # The expert choice is discrete, from router logits that the two paths compute with different GEMMs (one
    # concatenated with the shared expert's, or alone) and the router ranks as fp32 probabilities: rounding can
    # only swap experts whose probabilities tie to a few fp32 ulps. With no near-tie among the top k + 1, the
    # choice (and its order) is equal.
    top = torch.softmax(F.linear(x, moe.gate.weight), -1, dtype=torch.float).topk(3, dim=-1).values
    assert float((top[:, :-1] - top[:, 1:]).min()) > 1e-5
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 7, 16, 17])
def test_transposed_expert_gemms_equal_plain(rows):
    torch.manual_seed(4)
    gate_up, down = torch.randn(5, 10, 8, dtype=torch.float64), torch.randn(5, 8, 5, dtype=torch.float64)
    x = torch.randn(5, rows, 8, dtype=torch.float64)
    with torch.no_grad():
        got = Experts._swiglu(x, gate_up, down)
    gate, up = (x @ gate_up.transpose(1, 2)).chunk(2, dim=-1)
    torch.testing.assert_close(got, (F.silu(gate) * up) @ down.transpose(1, 2), rtol=1e-12, atol=1e-12)
