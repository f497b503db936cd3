"""Flat varlen causal depthwise conv == torch's Conv1d run on each sequence alone; windows carry it across steps."""

import pytest
import torch
import torch.nn.functional as F

from flashnext.batch import make_segments
from flashnext.ops.conv import causal_conv1d_varlen


def _seg(lens):
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    return make_segments(cu, sum(lens))


def _conv1d_alone(seq: torch.Tensor, w: torch.Tensor, dilation: int, pad: int) -> torch.Tensor:
    """torch's Conv1d over one sequence [n, C], left-padded by `pad` zeros -> [n, C]."""
    return F.conv1d(F.pad(seq.T.unsqueeze(0), (pad, 0)), w.unsqueeze(1), groups=w.shape[0], dilation=dilation)[0].T


@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("lens", [[1], [7, 0, 12, 2], [30]], ids=["len1", "mixed", "long"])
def test_matches_conv1d_per_sequence(dilation, lens):
    C, K = 5, 4
    T = sum(lens)
    x = torch.randn(T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, requires_grad=True)
    out, final = causal_conv1d_varlen(x, _seg(lens), w, dilation)
    assert final is None
    pad = (K - 1) * dilation
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    ref = torch.cat(
        [_conv1d_alone(x[s : s + n], w, dilation, pad) for s, n in zip(starts.tolist(), lens, strict=True) if n]
    )
    torch.testing.assert_close(out, ref)
    gw = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad((out * gw).sum(), (x, w)), torch.autograd.grad((ref * gw).sum(), (x, w))
    )


@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize(
    "lens", [[1, 1, 1], [5, 0, 2, 13], [1], [0, 0]], ids=["decode", "mixed", "one-token", "zero-length"]
)
def test_window_continues_the_sequence(dilation, lens):
    """With an initial window, each sequence's output and final window equal one pass over window + sequence."""
    C, K = 6, 4
    W = (K - 1) * dilation
    N = len(lens)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(lens), C, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, generator=g)
    # Each sequence's full history: 11 earlier rows, of which the window holds the last W.
    history = torch.randn(N, 11, C, dtype=torch.float64, generator=g)
    seg = _seg(lens)
    out, final = causal_conv1d_varlen(x, seg, w, dilation, initial_window=history[:, -W:])
    starts = torch.tensor([0, *lens]).cumsum(0).tolist()
    for i, n in enumerate(lens):
        whole = torch.cat([history[i], x[starts[i] : starts[i] + n]])
        ref = _conv1d_alone(whole, w, dilation, W)
        torch.testing.assert_close(out[starts[i] : starts[i] + n], ref[11:])
        torch.testing.assert_close(final[i], whole[-W:])
    if x.numel():  # gradients reach x through the windowed path too
        (gx,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(gx).all() and gx.abs().sum() > 0


def test_zero_window_is_the_fresh_sequence():
    """A zero window equals no window (what precedes a sequence start), and the final window is then its tail."""
    lens = [4, 9]
    x = torch.randn(13, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    seg = _seg(lens)
    plain, none = causal_conv1d_varlen(x, seg, w, 2)
    zeros, final = causal_conv1d_varlen(x, seg, w, 2, initial_window=torch.zeros(2, 6, 3, dtype=torch.float64))
    asked, final2 = causal_conv1d_varlen(x, seg, w, 2, output_final_window=True)
    assert none is None
    torch.testing.assert_close(zeros, plain)
    torch.testing.assert_close(asked, plain)
    torch.testing.assert_close(final, final2)
    torch.testing.assert_close(final[0], torch.cat([torch.zeros(2, 3, dtype=torch.float64), x[:4]]))
    torch.testing.assert_close(final[1], x[-6:])


@pytest.mark.parametrize("dilation", [1, 3])
def test_equal_lengths_take_the_block_path_bit_for_bit(dilation, monkeypatch):
    """Sequences of one length with windows (a speculative verify step) run `_equal_rows`, and its rows and final
    windows equal, bit for bit, the general path's (the same taps summed in the same order): those sequences
    followed by a shorter one, which sends the stream through the history layout."""
    from flashnext.ops import conv

    calls = []
    fast = conv._equal_rows
    monkeypatch.setattr(conv, "_equal_rows", lambda *a: calls.append(1) or fast(*a))
    C, K, L, N = 6, 4, 4, 3
    W = (K - 1) * dilation
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N * L + 2, C, generator=g)
    w = torch.randn(C, K, generator=g)
    window = torch.randn(N + 1, W, C, generator=g)
    out, final = causal_conv1d_varlen(x[: N * L], _seg([L] * N), w, dilation, initial_window=window[:N])
    assert calls == [1]
    ref_out, ref_final = causal_conv1d_varlen(x, _seg([L] * N + [2]), w, dilation, initial_window=window)
    assert calls == [1]  # the mixed stream took the general path
    assert torch.equal(out, ref_out[: N * L]) and torch.equal(final, ref_final[:N])
