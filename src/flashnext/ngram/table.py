"""`NgramTable`: the one interface of a frozen PLE n-gram table, whatever holds its rows.

`NGramEmbedding.ngram_embedding` is called as `table(ids [*S]) -> rows [*S, d]`. A trainable table is a plain
`nn.Embedding` (or, under `parallelize`, an `OwnerRoutedEmbedding`); every frozen storage subclasses `NgramTable`:
`StoredNGramTable` (`stored`: FP8 + scale, BF16, FP32 rows as on disk), `NF4NGramTable` (`nf4`: 4-bit codes) and
`OnDiskNGramTable` (`mmap`: rows read from the checkpoint files). Callers ask the table, not its class:
- `table(ids)`: the looked-up rows in `table.dtype`;
- `table.storage`: the storage kind (`"stored"`, `"nf4"`, `"mmap"`);
- `table.nbytes`: bytes the table keeps in memory (its rows, codes and scales, or its row cache);
- `table.saved_entries(name, style, parts, directory)`: the `(disk key, tensor)` pairs `save_pretrained` writes for
  it besides `state_dict` (rows that stay in the files), or a `CheckpointError` when it cannot be saved;
- `table.disk_keys`: the on-disk keys it reads itself, which `load_checkpoint` leaves alone.
`checkpoint/` reaches the last two by name (`saved_entries`, `disk_keys`): it imports no table class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import nn


def apply_keeping_storage(module: nn.Module, fn) -> nn.Module:
    """`Module._apply` for a table holding stored rows in its buffers and its output dtype in `module.dtype`.

    `fn` is e.g. `t.to(dtype) if t.is_floating_point()` (Module.to/.half/.float), `t.to(device)` or
    `empty_like(t, device=...)` (to_empty). Handing it a byte view of each buffer keeps the stored dtype through
    dtype casts (a 51 GB FP8 table silently upcast to 102 GB BF16 by `model.to(torch.bfloat16)` is what this
    prevents) while moves and to_empty still apply; the output dtype follows the cast instead.
    """
    device = None
    for name, buf in list(module._buffers.items()):
        if buf is not None:
            raw = fn(buf.reshape(-1).view(torch.uint8))
            module._buffers[name] = raw.view(buf.dtype).reshape(buf.shape)
            device = raw.device
    module.dtype = fn(torch.empty(0, dtype=module.dtype, device=device)).dtype
    return module


class NgramTable(nn.Module, ABC):
    """A frozen `[R, d]` n-gram table (no parameters) whose lookups come out in `self.dtype`.

    Subclasses set `num_embeddings` (R), `embedding_dim` (d) and `dtype`, and define `storage`, `forward` and
    `nbytes`. Model-wide dtype casts (`model.to(torch.bfloat16)`) change the output dtype only, never the stored
    rows (`apply_keeping_storage`); device moves and `to_empty` apply as usual.
    """

    storage: str  # the storage kind: "stored", "nf4" or "mmap"
    disk_keys: frozenset[str] = frozenset()  # on-disk keys this table reads itself (the loader skips them)

    @abstractmethod
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int [*S] -> rows [*S, d] in `self.dtype`."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes this table keeps in memory."""

    def saved_entries(self, name: str, style: str, parts: int, directory: Path) -> list[tuple[str, torch.Tensor]]:
        """(disk key, tensor) pairs to write for the table `name` besides `state_dict`: none by default (its rows
        are buffers in `state_dict`).

        Args:
            name: the table's module name (`...ngram_embedding`).
            style: the checkpoint naming style (`checkpoint.layout`).
            parts: `split_ngram_parts`, the number of shards a table is cut into.
            directory: where the checkpoint is being written.
        """
        return []

    def _apply(self, fn, recurse: bool = True):
        return apply_keeping_storage(self, fn)
