"""Block-scaled FP8 weights (the official FP8 checkpoint's routed experts): the spec of quantising and dequantising.

A weight `w [R, C]` is stored as `q [R, C]` float8_e4m3fn plus `scale_inv [ceil(R/b), ceil(C/b)]` (BF16 in the
official checkpoint), one value per `b x b` block (b = 128); despite its name `weight_scale_inv` is a multiplier:
`w ~= q * scale_inv[r // b, c // b]`. A last block that runs past the edge covers only the rows/columns left (the
grid is a ceiling, as vLLM reads it).

`dequantize_blocks` computes `(q.float() * scale.float()).to(dtype)`, the same products transformers' `Fp8Dequantize`
forms, so a checkpoint dequantised here and there agrees bit for bit in fp32 and bf16. `quantize_blocks` is the
writer's side: per block `scale = amax / 448` rounded to the scale dtype, `q = clamp(w / scale, +-448)`.

Legend: R rows (output features), C columns (input features), b block side, n leading (expert) dims.
"""

from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def scale_grid(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """The scale grid of a `[rows, cols]` weight in `block x block` blocks: `(ceil(rows/b), ceil(cols/b))`."""
    return -(-rows // block), -(-cols // block)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """scale [*n, gr, gc] -> fp32 [*n, rows, cols]: each value repeated over its block, cut at the edges."""
    s = scale.float().repeat_interleave(block, dim=-2)[..., :rows, :]
    return s.repeat_interleave(block, dim=-1)[..., :cols]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """q [*n, R, C] (float8) with scale [*n, ceil(R/b), ceil(C/b)] -> [*n, R, C] in `dtype`: `q * scale` in fp32.

    Whole blocks multiply through a block view (no expanded scale); a grid with a partial edge block expands the
    scale first. Both form the same fp32 products, so the result does not depend on the path.
    """
    rows, cols = q.shape[-2:]
    gr, gc = scale.shape[-2:]
    if rows == gr * block and cols == gc * block:
        blocks = q.float().unflatten(-1, (gc, block)).unflatten(-3, (gr, block))  # [*n, gr, b, gc, b]
        return (blocks * scale.float()[..., :, None, :, None]).to(dtype).reshape(q.shape)
    return (q.float() * _expand(scale, rows, cols, block)).to(dtype)


def quantize_blocks(
    w: torch.Tensor, block: int = BLOCK, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] (any float dtype) -> (q [R, C] float8_e4m3fn, scale_inv [ceil(R/b), ceil(C/b)] in `scale_dtype`).

    Per block `scale = amax / 448`, rounded to `scale_dtype` first so that `q * scale` (the reader's product) uses
    the value `w` was divided by; an all-zero block gets scale 1. `w / scale` is computed in fp32 and clamped to
    +-448 (a scale rounded down by `scale_dtype` may push the block's largest value a hair past it).
    """
    rows, cols = w.shape
    gr, gc = scale_grid(rows, cols, block)
    padded = torch.zeros(gr * block, gc * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    amax = padded.view(gr, block, gc, block).abs().amax(dim=(1, 3))  # [gr, gc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (w.float() / _expand(scale, rows, cols, block)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale
