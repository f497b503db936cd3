"""Flat varlen causal depthwise conv == torch's Conv1d run on each sequence alone."""

import pytest
import torch
import torch.nn.functional as F

from flashnext.ops.conv import causal_conv1d_varlen


@pytest.mark.parametrize("dilation", [1, 3])
@pytest.mark.parametrize("lens", [[1], [7, 0, 12, 2], [30]], ids=["len1", "mixed", "long"])
def test_matches_conv1d_per_sequence(dilation, lens):
    C, K = 5, 4
    T = sum(lens)
    x = torch.randn(T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    pos = torch.cat([torch.arange(n) for n in lens]) if T else torch.zeros(0, dtype=torch.long)
    out = causal_conv1d_varlen(x, w, pos, dilation)
    pad = (K - 1) * dilation
    ref = []
    for s, n in zip(starts.tolist(), lens, strict=True):
        if n == 0:
            continue
        seq = x[s : s + n].T.unsqueeze(0)
        ref.append(F.conv1d(F.pad(seq, (pad, 0)), w.unsqueeze(1), groups=C, dilation=dilation)[0].T)
    ref = torch.cat(ref)
    torch.testing.assert_close(out, ref)
    gw = torch.randn_like(out)
    torch.testing.assert_close(
        torch.autograd.grad((out * gw).sum(), (x, w)), torch.autograd.grad((ref * gw).sum(), (x, w))
    )
