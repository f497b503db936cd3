"""Sort-based grouped dispatch, the per-assignment gather path and the every-expert path of a static serving step
== a plain loop over experts."""

import pytest
import torch
import torch.nn.functional as F

from flashnext.config import TextConfig
from flashnext.model import fused
from flashnext.model.moe import SORTED_ASSIGNMENTS, Experts, SparseMoE
from flashnext.model.state import DECODE, Step
from flashnext.ops import grouped_experts


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
    torch.testing.assert_close(moe.experts(x, e, w, Step(DECODE, static=True)), ref)
    torch.testing.assert_close(moe.experts._reduced(x, e, w), ref)  # the compiled fp32 form, run eagerly


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


def test_gathered_bf16_sums_without_index_add():
    """The decode gather path sums each token's k expert outputs without `index_add` (a bf16 `index_add` on CPU is
    a `scatter_add_` that opens a parallel region: 17-240 ms at 2 threads on a loaded box, once per MoE layer of a
    bf16 decode step) and stays the loop's function: bf16 inputs against the fp64 loop on the same (bf16-rounded)
    values, within bf16's resolution relative to the output's scale (the gate/up products, the SwiGLU and the down
    products are each rounded to 8 mantissa bits, 0.4% of the largest term each: 2% of the largest output)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(4)
    ex = Experts(_cfg(E=16, k=4))
    torch.nn.init.normal_(ex.gate_up_proj, std=0.5)
    torch.nn.init.normal_(ex.down_proj, std=0.5)
    ex = ex.bfloat16()
    x = torch.randn(1, 8).bfloat16()
    e = torch.tensor([[3, 0, 9, 5]])
    w = torch.rand(1, 4).bfloat16()
    with Ops() as ops:
        out = ex(x, e, w, step=Step(DECODE))
    assert not {"index_add", "index_add_", "scatter_add", "scatter_add_"} & ops.names, sorted(ops.names)
    ref = _loop_reference(ex.double(), x.double(), e, w.double())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-2 * float(ref.detach().abs().max()))


def test_a_few_tokens_of_small_experts_gather_on_a_serving_step():
    """A serving (fused, not static) step whose assignments' expert weights total at most `GATHER_BYTES` takes the
    gather path even past E/2 assignments (a speculative verify step's 2-4 tokens: no sort, no slab, no host read of
    its capacity), with the grouped path's result; more bytes, a training step or a static step keep their paths."""
    from flashnext.model import moe as moe_mod
    from flashnext.model.state import VERIFY

    torch.manual_seed(5)
    ex = Experts(_cfg(E=8, k=2))
    torch.nn.init.normal_(ex.gate_up_proj)
    torch.nn.init.normal_(ex.down_proj)
    calls = []
    for name in ("_gathered", "_grouped", "_dense"):
        f = getattr(ex, name)
        setattr(ex, name, lambda *a, _f=f, _n=name: calls.append(_n) or _f(*a))
    x = torch.randn(3, 8)
    e = torch.stack([torch.randperm(8)[:2] for _ in range(3)])  # 6 assignments of 8 experts: more than E/2
    w = torch.rand(3, 2)
    want = ex._grouped(x, e.flatten(), w, True)
    calls.clear()
    torch.testing.assert_close(ex(x, e, w, Step(VERIFY)), want)
    ex(x, e, w)  # training
    ex(x, e, w, Step(DECODE, static=True))
    per = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * 4
    assert 6 * per <= moe_mod.GATHER_BYTES and calls == ["_gathered", "_grouped", "_dense"]


def test_fp32_prefill_slab_keeps_the_row_major_products(monkeypatch):
    """An fp32 serving prefill (fused, a few rows per expert) runs the slab's row-major expert products (tokens
    times weights, as the training form does; MKL's transposed fp32 form was up to 2.7x slower there) and equals
    the loop (fp32 sums: 1e-5)."""
    torch.manual_seed(4)
    ex = Experts(_cfg(E=16, k=4))
    ex.gate_up_proj.data = torch.randn(16, 64, 96) * 0.1  # [E, 2I, D] at I = 32, D = 96
    ex.down_proj.data = torch.randn(16, 96, 32) * 0.1
    x = torch.randn(32, 96)
    e = torch.stack([torch.randperm(16)[:4] for _ in range(32)])
    w = torch.rand(32, 4)
    firsts, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: firsts.append(tuple(a.shape)) or bmm(a, b))
    with torch.inference_mode():
        out = ex._grouped(x, e.flatten(), w, fused=True)
    cap = int(torch.bincount(e.flatten(), minlength=16).max())
    assert cap <= 16 and firsts == [(16, cap, 96), (16, cap, 32)]  # the slab's rows first, not the weights
    torch.testing.assert_close(out, _loop_reference(ex, x, e, w), rtol=1e-5, atol=1e-5)


def _routed_moe(seed: int, dtype: torch.dtype, tokens: int):
    """(moe, x, routing weights, experts): a random MoE of 6 experts, top-2, in `dtype`, and `tokens` routed
    tokens (4 or 9: 8 or 18 assignments, more than the gather path takes)."""
    torch.manual_seed(seed)
    moe = SparseMoE(_cfg(E=6, k=2)).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(tokens, 8, dtype=dtype)
    w, e = moe.gate(x)
    return moe, x, w, e


def _traced_static_step(ex, x, e, w):
    """`ex` on a static decode step traced by dynamo (what the CPU decode graph compiles), run as traced: (output,
    the ops of the traced graph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        step = torch.compile(lambda *a: ex(*a, Step(DECODE, static=True)), backend=backend, fullgraph=True)
        got = step(x, e, w)
    return got, {str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")}


@pytest.fixture
def sums(monkeypatch):
    """The compiled static step's experts as `reduced_experts` (the kernel `ops.grouped_experts` not loaded)."""
    monkeypatch.setattr(grouped_experts, "_BUILT", [False])


@pytest.mark.parametrize("tokens", [9, 4], ids=["3_per_expert", "1.3_per_expert"])
def test_compiled_static_step_sums_each_assignment_in_expert_order(tokens, sums):
    """Traced by dynamo (what the CPU decode graph compiles), an fp32 static step's experts are `_reduced`: sums
    over each assignment's expert rows (no batched GEMM over every expert), taken in expert order (an argsort of
    the routed ids, the routing order restored before each token's sum) when there are at least
    `SORTED_ASSIGNMENTS` assignments per expert, else in routing order. Against the fp64 loop on the same inputs:
    fp32 sums of 8-term products, 1e-5."""
    moe, x, w, e = _routed_moe(4, torch.float64, tokens)
    ref = _loop_reference(moe.experts, x.float().double(), e, w.float().double())
    got, ops = _traced_static_step(moe.experts.float(), x.float(), e, w.float())
    assert not any("bmm" in op for op in ops), ops
    assert any("argsort" in op for op in ops) == (2 * tokens >= SORTED_ASSIGNMENTS * 6), ops
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False], ids=["bf16_cpu", "avx2_cpu"])
@pytest.mark.parametrize("tokens", [4, 9], ids=["1.3_per_expert", "3_per_expert"])
def test_compiled_bf16_static_step_sums_only_below_two_assignments_per_expert(tokens, native, monkeypatch, sums):
    """Traced by dynamo, a bf16 static step's experts are `_reduced` (fp32 sums over each assignment's expert rows,
    no batched GEMM) below `SORTED_ASSIGNMENTS` assignments per expert, where they beat oneDNN's batched GEMMs over
    every expert, and `_dense` (bmm) from there on, where they lose (`Experts._sums_pay`); on a CPU without bf16
    instructions (`fused.NATIVE_GEMM`), where bf16 GEMMs are emulated, always `_reduced`, as fp32. Both against
    the fp64 loop on the same bf16 values: bf16 rounding of the products' inputs and outputs, 2e-2 of the largest
    output."""
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
    moe, x, w, e = _routed_moe(5, torch.bfloat16, tokens)
    ref = _loop_reference(moe.experts.double(), x.double(), e, w.double())
    got, ops = _traced_static_step(moe.experts.bfloat16(), x, e, w)
    assert any("bmm" in op for op in ops) == (native and 2 * tokens >= SORTED_ASSIGNMENTS * 6), ops
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-2 * float(ref.detach().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [9, 4], ids=["3_per_expert", "1.3_per_expert"])
def test_compiled_static_step_runs_the_grouped_kernel_once_loaded(dtype, tokens, monkeypatch):
    """Once `ops.grouped_experts` is loaded (the decode graphs load it), a traced CPU static step's routed experts
    are that kernel from `SORTED_ASSIGNMENTS` assignments per expert on (one op, no sums or GEMMs of their own),
    the sums below; against the fp64 loop on the same values (fp32 sums: 1e-5; bf16: the rounding of the output,
    2e-2 of the largest)."""
    assert grouped_experts.available()
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, False)  # bf16 sums in fp32 at any count (`_sums_pay`)
    moe, x, w, e = _routed_moe(6, dtype, tokens)
    ref = _loop_reference(moe.experts.double(), x.double(), e, w.double())
    got, ops = _traced_static_step(moe.experts.to(dtype), x, e, w)
    kernel = 2 * tokens >= SORTED_ASSIGNMENTS * 6
    assert any("grouped_experts" in op for op in ops) == kernel and not any("bmm" in op for op in ops), ops
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * float(ref.detach().abs().max())
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
