"""4-bit n-gram rows (vLLM's NF4 option): 16 Lloyd-Max levels of a unit Gaussian times an fp16 scale per row.

A row of `d` values is `d / 2` bytes of codes (two 4-bit codes per byte: column `2i` in the low nibble, `2i + 1` in
the high one) plus its fp16 scale: 82 bytes for the official 160-wide rows, against 160 (FP8) or 320 (BF16). The
levels are the optimal 16-level quantiser of N(0, 1) (Lloyd-Max: each level is the mean of its cell, each cell
boundary the midpoint of two levels), computed here by Lloyd's iteration. The table's rows are near-isotropic
Gaussians, so the per-row scale is searched around the row's RMS (the optimum for an exact Gaussian) on a small
grid, keeping the one with the least squared error: the stored fp16 value is the one searched.

This is lossy and in-memory only: `from_pretrained(..., ngram_storage="nf4")` quantises a BF16/FP32/FP8 table
shard by shard at load; there is no NF4 checkpoint layout to save back to (`save_pretrained` refuses).
The scale grid is `rms x {0.80, 0.85, ..., 1.20}`; on Gaussian rows it gives a relative MSE of 0.0081 (the plain
RMS scale: 0.0095).

Legend: R rows, d row width (even), N looked-up ids.
"""

from __future__ import annotations

import math

import torch

from flashnext.errors import CheckpointError
from flashnext.ngram.table import NgramTable

SCALE_GRID = tuple(0.8 + 0.05 * i for i in range(9))  # multiples of the row RMS tried as the scale


def lloyd_max_gaussian(levels: int = 16, iterations: int = 300) -> list[float]:
    """The `levels` reconstruction points of the mean-squared-error optimal quantiser of N(0, 1), ascending."""
    pdf = lambda x: 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    points = [2.5 * (2 * (i + 0.5) / levels - 1) for i in range(levels)]
    for _ in range(iterations):
        edges = [-math.inf, *((a + b) / 2 for a, b in zip(points, points[1:], strict=False)), math.inf]
        # The mean of N(0, 1) over [a, b): (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)).
        points = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:], strict=False)]
    return points


NF4_LEVELS = torch.tensor(lloyd_max_gaussian(), dtype=torch.float32)  # [16]
_EDGES = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2  # [15] cell boundaries


def _codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest level of x / scale: x [N, d] fp32, scale [N, 1] fp32 (non-zero) -> int64 [N, d] in 0..15."""
    return torch.bucketize(x / scale, _EDGES)


def quantize_nf4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [N, d] (any float dtype, d even) -> (codes uint8 [N, d/2], scale fp16 [N]).

    Each row's scale is the value of `rms * SCALE_GRID`, rounded to fp16, with the least squared error.
    """
    x = rows.float()
    rms = x.square().mean(-1, keepdim=True).sqrt()  # [N, 1]
    best_err = torch.full((x.shape[0], 1), math.inf)
    best_scale = torch.zeros(x.shape[0], 1, dtype=torch.float16)
    best_codes = torch.zeros_like(x, dtype=torch.int64)
    for factor in SCALE_GRID:
        scale16 = (rms * factor).to(torch.float16)
        scale = scale16.float()
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any code, scale 0
        codes = _codes(x, divisor)
        err = (NF4_LEVELS[codes] * scale - x).square().sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale16, best_scale)
        best_codes = torch.where(better, codes, best_codes)
    packed = (best_codes[:, 0::2] | (best_codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, best_scale.squeeze(-1)


def dequantize_nf4(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes uint8 [N, d/2], scale fp16 [N] -> rows [N, d] in `dtype`: `level[code] * scale` computed in fp32."""
    idx = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).long()  # [N, d]
    return (NF4_LEVELS.to(codes.device)[idx] * scale.float()[:, None]).to(dtype)


class NF4NGramTable(NgramTable):
    """A frozen `[R, d]` table held as NF4 codes plus an fp16 scale per row; lookups come out in `dtype`.

    Buffers `codes [R, d/2]` (uint8) and `row_scale [R]` (fp16) are not persistent (no checkpoint layout holds
    them): they are filled by `fill` from the stored table (`source`, set by `ngram.storage`, which also sets
    `disk_keys`). Model-wide dtype casts change the output dtype only.
    """

    storage = "nf4"

    def __init__(self, num_embeddings: int, embedding_dim: int, *, dtype: torch.dtype, device=None):
        super().__init__()
        if embedding_dim % 2:
            raise ValueError(f"NF4 rows pack two values per byte: row width {embedding_dim} must be even")
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.source = None  # the `TableOnDisk` quantised into it at load (`ngram.storage`)
        codes = torch.zeros(num_embeddings, embedding_dim // 2, dtype=torch.uint8, device=device)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("row_scale", torch.zeros(num_embeddings, dtype=torch.float16, device=device), False)

    @torch.no_grad()
    def fill(self, start: int, rows: torch.Tensor) -> None:
        """Quantise `rows [n, d]` (float) into table rows `[start, start + n)`."""
        codes, scale = quantize_nf4(rows)
        self.codes[start : start + rows.shape[0]] = codes.to(self.codes.device)
        self.row_scale[start : start + rows.shape[0]] = scale.to(self.row_scale.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int [*S] -> [*S, d] in `self.dtype`."""
        flat = ids.reshape(-1).to(self.codes.device, torch.long)
        rows = dequantize_nf4(self.codes.index_select(0, flat), self.row_scale.index_select(0, flat), self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        """The codes' bytes plus the row scales'."""
        return self.codes.nbytes + self.row_scale.nbytes

    def saved_entries(self, name: str, style: str, parts: int, directory) -> list:
        """Refused for a table quantised from a checkpoint (`source` set): NF4 is lossy and in memory only.

        Raises:
            CheckpointError: naming the table.
        """
        if self.source is None:
            return []
        raise CheckpointError(
            f"cannot save {name}: an NF4 table is a lossy in-memory copy with no checkpoint layout; save from "
            "the checkpoint it was quantised from (or load that one with another ngram_storage)"
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, NF4 codes + fp16 row scales -> {self.dtype}"
