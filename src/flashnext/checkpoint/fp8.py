"""The official FP8 n-gram table format: float8_e4m3fn rows and one scale per table (`amax / 448`).

`dequantize_rows` is the spec of every FP8/stored-dtype lookup (in memory, read from disk, owner-routed, and the
per-shard upcast at load), so all of them produce the same bits for the same stored rows.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def fp8_scale(amax: float) -> float:
    """The per-table scale of the official FP8 layout: `amax / 448`, so the largest |value| maps to 448.

    An all-zero table gets scale 1 (any scale reproduces it; 0 would divide by zero when quantising).
    """
    return amax / FP8_MAX if amax > 0 else 1.0


def quantize_fp8(values: torch.Tensor, scale: float) -> torch.Tensor:
    """values [*S] (any float dtype) -> float8_e4m3fn [*S] holding `values / scale`, rounded to nearest.

    Computed in fp32; values are clamped to +-448 first (with `scale = amax / 448` only fp32 rounding of the
    division can step past it, and the cast would otherwise saturate silently).
    """
    return (values.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [N, d] -> [N, d] in `dtype`: `rows.to(dtype) * scale.to(dtype)` (vLLM's FP8 lookup), or a cast.

    The spec of every FP8/stored-dtype lookup here (in memory, read from disk, owner-routed, and the per-shard
    upcast at load), so all of them produce the same bits for the same stored rows.
    """
    out = rows.to(dtype)
    return out if scale is None else out * scale.to(dtype)
