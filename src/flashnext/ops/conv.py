"""Causal depthwise convolution over a flat stream, resetting at every sequence start.

Legend: T tokens, C channels, K kernel taps.
"""

from __future__ import annotations

import torch


def causal_conv1d_varlen(
    x: torch.Tensor, weight: torch.Tensor, pos_in_seq: torch.Tensor, dilation: int = 1
) -> torch.Tensor:
    """Depthwise causal conv: `out[t] = sum_k weight[:, K-1-k] * x[t - k*dilation]` within t's sequence.

    Args:
        x: [T, C] input.
        weight: [C, K] depthwise taps (the `[C, 1, K]` Conv1d weight squeezed); tap K-1 sees the current token.
        pos_in_seq: int64 [T], offset of every token from its sequence start (taps before it read zeros).
        dilation: spacing between taps.

    Returns:
        [T, C] in `weight`'s dtype; taps are summed in fp32 (as a bf16 `Conv1d` accumulates), then rounded once.
    """
    T, C = x.shape
    K = weight.shape[-1]
    out_dtype = weight.dtype
    acc = torch.promote_types(out_dtype, torch.float32)
    x = x.to(out_dtype).to(acc)
    weight = weight.to(acc)
    pad = (K - 1) * dilation
    x_pad = torch.cat([x.new_zeros(pad, C), x], dim=0)
    out = x * weight[:, K - 1]
    for k in range(1, K):
        shift = k * dilation
        visible = (pos_in_seq >= shift).to(x.dtype).unsqueeze(-1)
        out = out + x_pad[pad - shift : pad - shift + T] * visible * weight[:, K - 1 - k]
    return out.to(out_dtype)
