"""n-gram tables kept in their stored dtype (FP8 with a per-table scale, or BF16/FP32), frozen.

The PLE lookup (`NGramEmbedding.ngram_embedding`) only needs `forward(ids [*S]) -> rows [*S, d]`. `nn.Embedding`
is the trainable table in the model dtype; `StoredNGramTable` here (an `NgramTable`, storage `"stored"`) keeps
the rows as they are stored on disk and converts only the gathered rows: `rows.to(dtype) * scale.to(dtype)` for
FP8 (the official FP8 layout has one scale per layer table), `rows.to(dtype)` otherwise. Dequantising *after* the
gather is what makes the table fit: an FP8 table costs 1 byte per value in memory instead of 2 (BF16) or 4 (FP32).

Legend: R table rows, d row width (`ple_embed_dim / ngram_heads`), N looked-up ids.
"""

from __future__ import annotations

import torch

from flashnext.checkpoint.fp8 import FP8_DTYPE, dequantize_rows
from flashnext.ngram.table import NgramTable


class StoredNGramTable(NgramTable):
    """A frozen `[R, d]` table in its stored dtype whose lookups come out in the model dtype.

    Holds buffers (never parameters: nothing trains them) `weight [R, d]` in `storage_dtype` and, for FP8,
    `weight_scale` (a scalar, shape `scale_shape`, in `scale_dtype`), named like the checkpoint's
    `...ngram_embedding.weight` / `...ngram_embedding.weight_scale`, so `save_pretrained` writes them back byte for
    byte. Model-wide dtype conversions (`model.to(torch.bfloat16)`, `.float()`) change only the output dtype, not
    the stored bytes (`NgramTable._apply`); device moves and `to_empty` apply as usual.

    Args:
        num_embeddings, embedding_dim: R and d.
        storage_dtype: dtype of the stored rows (`torch.float8_e4m3fn`, `torch.bfloat16`, `torch.float32`, ...).
        dtype: dtype of the looked-up rows (the model's compute dtype).
        scale_dtype: dtype of `weight_scale`; None: no scale (only allowed for non-FP8 storage).
        scale_shape: shape of the stored scale (`()` or `(1,)`; exports differ).
        device: where the buffers are allocated (`meta` to fill them later from a checkpoint).
    """

    storage = "stored"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        storage_dtype: torch.dtype,
        dtype: torch.dtype,
        scale_dtype: torch.dtype | None = None,
        scale_shape: tuple[int, ...] = (),
        device=None,
    ):
        super().__init__()
        if storage_dtype == FP8_DTYPE and scale_dtype is None:
            raise ValueError("an FP8 n-gram table needs a scale (scale_dtype)")
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=storage_dtype, device=device))
        scale = None if scale_dtype is None else torch.ones(scale_shape, dtype=scale_dtype, device=device)
        self.register_buffer("weight_scale", scale)

    @classmethod
    def from_values(cls, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> StoredNGramTable:
        """A table holding `weight [R, d]` (kept in its dtype, not copied) and `scale` (or None)."""
        table = cls(
            weight.shape[0], weight.shape[1], storage_dtype=weight.dtype, dtype=dtype,
            scale_dtype=None if scale is None else scale.dtype, scale_shape=() if scale is None else scale.shape,
            device="meta",
        )  # fmt: skip
        table.weight, table.weight_scale = weight, scale
        return table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int [*S] -> [*S, d] in `self.dtype`."""
        rows = self.weight.index_select(0, ids.reshape(-1).to(self.weight.device, torch.long))
        out = dequantize_rows(rows, self.weight_scale, self.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        """The stored rows' bytes plus the scale's."""
        return sum(b.nbytes for b in (self.weight, self.weight_scale) if b is not None)

    def extra_repr(self) -> str:
        scale = "" if self.weight_scale is None else f", scale {self.weight_scale.dtype}"
        return f"{self.num_embeddings}, {self.embedding_dim}, stored {self.weight.dtype}{scale} -> {self.dtype}"
