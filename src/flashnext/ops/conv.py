"""Causal depthwise convolution over a flat stream, resetting at every sequence start, with an optional window.

Training calls it with no window: taps before a sequence start read zeros. Serving (and context parallelism)
passes each sequence's `initial_window`, the W = (K - 1) * dilation input rows that precede it (zeros for a fresh
sequence, which is the training case), and gets back the window that follows it. With a window the conv runs on
the stream extended by those rows (`batch.prepend_history`), so the taps see exactly what one pass over the whole
sequence would; a decode step (one token per sequence) computes just that token's row.

Legend: T tokens, N sequences, C channels, K kernel taps, W window rows.
"""

from __future__ import annotations

import torch

from flashnext.batch import Segments, last_rows, prepend_history


def causal_conv1d_varlen(
    x: torch.Tensor,
    seg: Segments,
    weight: torch.Tensor,
    dilation: int = 1,
    initial_window: torch.Tensor | None = None,
    output_final_window: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv: `out[t] = sum_k weight[:, K-1-k] * x[t - k*dilation]` within t's sequence.

    Args:
        x: [T, C] input.
        seg: the stream's segments (`pos_in_seq`; host lengths when a window is involved).
        weight: [C, K] depthwise taps (the `[C, 1, K]` Conv1d weight squeezed); tap K-1 sees the current token.
        dilation: spacing between taps.
        initial_window: optional [N, W, C], the input rows before each sequence (W = (K - 1) * dilation).
        output_final_window: return the window after each sequence even without an initial one (zeros assumed).

    Returns:
        y [T, C] in `weight`'s dtype (taps summed in fp32, as a bf16 `Conv1d` accumulates, then rounded once) and
        the final window [N, W, C] in x's dtype: the last W rows of each sequence's window followed by its rows
        (None when neither a window was given nor asked for).
    """
    K = weight.shape[-1]
    W = (K - 1) * dilation
    if initial_window is None and not output_final_window:
        return _conv(x, weight, seg.pos_in_seq, dilation), None
    if initial_window is None:
        initial_window = x.new_zeros(len(seg.lengths), W, x.shape[1])
    if not seg.is_decode and len(set(seg.lengths)) == 1 and seg.lengths[0] > 0:
        return _equal_rows(x, initial_window, weight, dilation)
    x_ext, layout = prepend_history(x, initial_window, seg)
    final = last_rows(x_ext, layout, seg)
    if seg.is_decode:  # only each sequence's new row: the same taps, in the same order
        return _last_row(x_ext.view(-1, W + 1, x.shape[1]), weight, dilation), final
    return _conv(x_ext, weight, layout.pos, dilation)[layout.real], final


def _conv(x: torch.Tensor, weight: torch.Tensor, pos_in_seq: torch.Tensor, dilation: int) -> torch.Tensor:
    """The conv over a flat stream whose sequences start where `pos_in_seq` is 0 (taps before read zeros)."""
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


def _equal_rows(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, dilation: int):
    """`causal_conv1d_varlen` with a window when every sequence has the same length L (a speculative verify step:
    each request's last token and as many drafts): each sequence's window and rows are one [W + L]-row block, so
    the taps are L-row slices of it (no history layout, index copies or visibility masks: the window holds every
    row a tap reads). The taps are summed in `_conv`'s order: the same result, bit for bit."""
    N, W = window.shape[:2]
    L, C = x.shape[0] // N, x.shape[1]
    x3 = torch.cat([window.to(x.dtype), x.view(N, L, C)], dim=1)  # [N, W + L, C]
    return _block_rows(x3, weight, dilation, L).view(N * L, C), x3[:, L:]


def _block_rows(x3: torch.Tensor, weight: torch.Tensor, dilation: int, L: int) -> torch.Tensor:
    """The conv at the last L rows of each [W + L]-row block x3 [N, W + L, C] -> [N, L, C], taps summed in `_conv`'s
    order."""
    K = weight.shape[-1]
    W = x3.shape[1] - L
    out_dtype = weight.dtype
    acc = torch.promote_types(out_dtype, torch.float32)
    x3 = x3.to(out_dtype).to(acc)
    weight = weight.to(acc)
    out = x3[:, W:] * weight[:, K - 1]
    for k in range(1, K):
        shift = k * dilation
        out = out + x3[:, W - shift : W - shift + L] * weight[:, K - 1 - k]
    return out.to(out_dtype)


def _last_row(x3: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """The conv at the last row of each [W + 1]-row block x3 [N, W + 1, C] -> [N, C] (the decode step)."""
    return _block_rows(x3, weight, dilation, 1)[:, 0]
