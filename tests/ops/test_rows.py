"""Row gathers/scatters with hand-written backwards (`ops.rows`) == `index_select` / `index_copy`, fwd and bwd."""

import pytest
import torch

from flashnext.ops import rows


def _x(shape, dtype=torch.float64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).requires_grad_()


def test_gather_rows_of_a_partial_permutation_matches_index_select():
    x = _x((9, 3, 2))
    index = torch.tensor([4, 0, 8, 2, 7])  # distinct rows, not all of them
    got, want = rows.gather_rows(x, index), x.index_select(0, index)
    assert torch.equal(got, want)
    w = torch.randn(got.shape, dtype=torch.float64).transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous
    assert torch.equal(torch.autograd.grad((got * w).sum(), x)[0], torch.autograd.grad((want * w).sum(), x)[0])


def test_scatter_rows_matches_index_copy_into_zeros():
    x = _x((4, 5))
    index = torch.tensor([6, 1, 3, 0])
    got = rows.scatter_rows(x, index, 8)
    want = x.new_zeros(8, 5).index_copy(0, index, x)
    assert torch.equal(got, want)
    w = torch.randn(8, 5, dtype=torch.float64)
    assert torch.equal(torch.autograd.grad((got * w).sum(), x)[0], torch.autograd.grad((want * w).sum(), x)[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_repeated_gather_matches_index_select(dtype):
    """Repeats, rows never gathered, and one plan shared by two tensors (as QSA's keys and values)."""
    g = torch.Generator().manual_seed(1)
    index = torch.randint(0, 10, (40,), generator=g)
    index[index == 3] = 4  # row 3 is never gathered: a zero-length segment
    plan = rows.RepeatedGather(index, 12)
    for seed in (0, 1):
        x = _x((12, 2, 3), dtype, seed)
        got, want = plan.gather(x), x.index_select(0, index)
        assert torch.equal(got, want)
        w = torch.randn(got.shape, generator=g, dtype=torch.float64).to(dtype)
        a = torch.autograd.grad((got * w).sum(), x)[0]
        # exact sums of few terms in fp64; fp32 accumulation for the low-precision ones (index_add_ sums in bf16)
        ref = x.detach().double().new_zeros(x.shape).index_add_(0, index, (w.double()))
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
