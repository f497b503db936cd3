"""The routed experts' CPU kernel (`ops.grouped_experts`) == its plain twin `model.moe.reduced_experts`, and both ==
the float64 computation of the same values."""

import pytest
import torch

from flashnext.model.moe import reduced_experts
from flashnext.ops import grouped_experts


@pytest.fixture(scope="module", autouse=True)
def built():
    assert grouped_experts.available(), "the grouped experts kernel did not build (see the log)"


def _case(E, D, I, T, k, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    down = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    x = torch.randn(T, D, generator=g)
    if skew:  # expert 0 in every token (more rows than one register block), most others idle
        rest = torch.stack([torch.randperm(E - 1, generator=g)[: k - 1] + 1 for _ in range(T)])
        experts = torch.cat([torch.zeros(T, 1, dtype=torch.long), rest], dim=1)
    else:
        experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, experts, torch.rand(T, k, generator=g), gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("E", "D", "I", "T", "k", "skew"),
    [(16, 256, 128, 16, 4, False), (16, 256, 128, 1, 4, False), (8, 37, 13, 5, 3, False), (6, 24, 8, 11, 2, True)],
    ids=["batch16", "batch1", "tails", "skewed"],
)
def test_kernel_matches_the_twin_and_fp64(E, D, I, T, k, skew, dtype):
    """Same values into the kernel, `reduced_experts` (fp32) and `reduced_experts` in float64: fp32 sums in other
    orders (register blocks of 8 lanes against inductor's / ATen's), so fp32 rounding apart: 1e-5 relative to the
    largest output. Cases: the bench shape, one token, sizes with scalar tails (37, 13: not multiples of 8), and
    one expert holding every token (11 rows: several register blocks) beside idle experts."""
    x, experts, weights, gate_up, down = _case(E, D, I, T, k, dtype, skew=skew)
    got = grouped_experts.grouped_experts(x, experts, weights, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == (T, D)
    exact = reduced_experts(x.double(), experts.flatten(), weights.double(), gate_up.double(), down.double())
    twin = reduced_experts(x, experts.flatten(), weights, gate_up, down)
    tol = 1e-5 * float(exact.abs().max())
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=tol)
    torch.testing.assert_close(got, twin, rtol=0, atol=tol)


def test_kernel_is_deterministic_across_threads():
    """No sum depends on how the work is split: 1 and 2 threads give the same bits. Bitwise by construction: each of
    the kernel's dot products is one work item's, whatever the split; its SiLU and routing-weighted sum are ATen ops
    on 8192 and 4096 elements here, below ATen's parallel grain (32768), so they run on one thread either way."""
    x, experts, weights, gate_up, down = _case(16, 256, 128, 16, 4, torch.float32, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = grouped_experts.grouped_experts(x, experts, weights, gate_up, down)
        torch.set_num_threads(2)
        two = grouped_experts.grouped_experts(x, experts, weights, gate_up, down)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_inputs_are_refused_before_any_read():
    """An expert id out of range, or weights that do not fit x, raise naming the value (the kernel reads raw
    pointers: a wrong shape would read past the weights)."""
    x, experts, weights, gate_up, down = _case(4, 16, 8, 3, 2, torch.float32)
    bad = experts.clone()
    bad[1, 0] = 4
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        grouped_experts.grouped_experts(x, bad, weights, gate_up, down)
    with pytest.raises(RuntimeError, match="do not fit x"):
        grouped_experts.grouped_experts(x, experts, weights, gate_up, down[:, :, :4].contiguous())
    with pytest.raises(RuntimeError, match="do not fit x"):
        grouped_experts.grouped_experts(x[:, :8], experts, weights, gate_up, down)


def test_traced_call_is_the_kernel():
    """Traced and compiled by inductor (as in a decode graph) the op is called as it is eagerly: the same bits."""
    x, experts, weights, gate_up, down = _case(16, 64, 32, 8, 4, torch.float32, seed=2)
    torch._dynamo.reset()
    compiled = torch.compile(grouped_experts.grouped_experts, fullgraph=True)
    eager = grouped_experts.grouped_experts(x, experts, weights, gate_up, down)
    assert torch.equal(compiled(x, experts, weights, gate_up, down), eager)
