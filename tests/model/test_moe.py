"""Sort-based grouped dispatch, the per-assignment gather path and the every-expert path of a static serving step
== a plain loop over experts."""

import pytest
import torch
import torch.nn.functional as F

from flashnext.config import TextConfig
from flashnext.model.moe import Experts, SparseMoE


def _cfg(E=6, k=2):
    return TextConfig(
        vocab_size=16,
        hidden_size=8,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=5,
        shared_expert_intermediate_size=3,
        hc_count=2,
        hc_lowrank=4,
    )


def _loop_reference(experts: Experts, x, top_e, top_w):
    out = torch.zeros_like(x)
    inter = experts.down_proj.shape[-1]
    for e in range(experts.num_experts):
        tok, slot = (top_e == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate_up = x[tok] @ experts.gate_up_proj[e].T
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tok, (h @ experts.down_proj[e].T) * top_w[tok, slot, None])
    return out


@pytest.mark.parametrize("T", [0, 1, 2, 37], ids=["empty", "decode1", "decode2", "prefill"])
def test_dispatch_matches_loop(T):
    torch.manual_seed(0)
    moe = SparseMoE(_cfg()).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(T, 8, dtype=torch.float64, requires_grad=True)
    w, e = moe.gate(x)
    out = moe.experts(x, e, w)
    ref = _loop_reference(moe.experts, x, e, w)
    torch.testing.assert_close(out, ref)
    if T:
        params = [x, moe.experts.gate_up_proj, moe.experts.down_proj, moe.gate.weight]
        g = torch.randn_like(out)
        torch.testing.assert_close(
            torch.autograd.grad((out * g).sum(), params, retain_graph=True),
            torch.autograd.grad((ref * g).sum(), params),
        )


@pytest.mark.parametrize("T", [2, 16], ids=["decode2", "decode16"])
def test_static_step_path_matches_loop(T):
    """A static serving step's paths (shapes independent of the routing): every expert (`_dense`), and each
    assignment's expert read in place (`_reduced`, what a compiled fp32 step runs) == the loop."""
    torch.manual_seed(3)
    moe = SparseMoE(_cfg()).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(T, 8, dtype=torch.float64)
    w, e = moe.gate(x)
    ref = _loop_reference(moe.experts, x, e, w)
    torch.testing.assert_close(moe.experts(x, e, w, fused=True, static=True), ref)
    torch.testing.assert_close(moe.experts._reduced(x, e.flatten(), w), ref)  # the compiled fp32 form, run eagerly


def test_both_paths_agree():
    torch.manual_seed(1)
    ex = Experts(_cfg(E=64, k=2)).double()
    torch.nn.init.normal_(ex.gate_up_proj)
    torch.nn.init.normal_(ex.down_proj)
    x = torch.randn(3, 8, dtype=torch.float64)
    e = torch.randint(0, 64, (3, 2))
    w = torch.rand(3, 2, dtype=torch.float64)
    torch.testing.assert_close(ex._grouped(x, e.flatten(), w), ex._gathered(x, e.flatten(), w))


def test_router_replay_uses_given_experts_and_keeps_router_grad():
    torch.manual_seed(2)
    moe = SparseMoE(_cfg()).double()
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(5, 8, dtype=torch.float64)
    forced = torch.tensor([[0, 1], [2, 3], [4, 5], [1, 0], [5, 2]])
    w, e = moe.gate(x, replay=forced)
    assert torch.equal(e, forced)
    torch.testing.assert_close(w.sum(-1), torch.ones(5, dtype=torch.float64))
    w.pow(2).sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


class _AtenNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Names of the aten ops run inside it (forward and the backward run on this thread)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_backward_moves_rows_without_scatter_add(dtype):
    """The training dispatch's backward is gathers, copies and a sum over k: no `scatter_add_`/`index_add`
    (index_select's CPU backward, slow with repeated rows), and its bf16 gradients stay within bf16 rounding of
    the fp64 loop (rtol/atol 2e-2 as the other bf16 op tests: bf16 inputs, fp32 accumulation)."""
    torch.manual_seed(4)
    moe = SparseMoE(_cfg()).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(29, 8, dtype=torch.float64)
    w, e = moe.gate(x)
    ex = Experts(_cfg()).to(dtype)
    ex.load_state_dict(moe.experts.state_dict())
    xl, wl = x.to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
    with _AtenNames() as seen:
        out = ex(xl, e, wl)
        g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        grads = torch.autograd.grad((out * g.to(dtype)).sum(), (xl, wl, ex.gate_up_proj, ex.down_proj))
    assert not seen.names & {"scatter_add_", "scatter_add", "index_add_", "index_add"}, sorted(seen.names)
    ref_in = [t.detach().double().requires_grad_() for t in (xl, wl, ex.gate_up_proj, ex.down_proj)]
    ref_ex = Experts(_cfg()).double()
    ref_ex.gate_up_proj, ref_ex.down_proj = torch.nn.Parameter(ref_in[2]), torch.nn.Parameter(ref_in[3])
    ref = _loop_reference(ref_ex, ref_in[0], e, ref_in[1])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), ref, **tol)
    ref_grads = torch.autograd.grad((ref * g).sum(), [ref_in[0], ref_in[1], ref_ex.gate_up_proj, ref_ex.down_proj])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a.double(), b, **tol)
