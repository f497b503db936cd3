"""Initialise a parallelised model's *local* parameters to exactly the values of the unsharded `init_weights(seed)`.

`FlashNextForCausalLM.init_weights(seed)` draws every random parameter, module by module, from one CPU generator;
a parameter's values therefore depend on everything drawn before it. `init_weights_local` walks the same modules in
the same order with the same generator and the same draws, and keeps only this rank's part:

- FSDP2 parameters (DTensors): the full parameter is drawn (one parameter at a time, on CPU) and this rank's shard
  is cut out locally (`distribute_tensor(..., src_data_rank=None)`: no communication);
- owner-routed n-gram tables: the full table's normals are drawn in flat chunks of `_CHUNK` values (a multiple of
  16, so the concatenated chunks equal one `torch.randn` of the whole table bit for bit, and the generator ends in
  the same state) and only the chunks' overlap with this rank's rows is written. Memory stays one chunk plus the
  local rows; time is that of drawing the whole table (every rank draws every value; a sequential generator cannot
  skip ahead). For the full-size tables that is minutes of CPU per table: a real run loads pretrained weights or a
  DCP checkpoint instead and passes `seed=None` to `parallelize`.

Both walk one ladder, `init_modules` (model/text.py); this module only says how a value is written (`LocalShardInit`).
`tests/parallel/test_fsdp.py` holds the two results equal at world sizes 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from flashnext.model.text import WholeTensorInit, init_modules
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding

__all__ = ["init_weights_local"]

_CHUNK = 1 << 20  # normals per draw of a table (a multiple of 16: see the module docstring)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _fill(p: torch.Tensor, make: Callable[[tuple[int, ...]], torch.Tensor]) -> None:
    """Write `make(full_shape)` into `p`, or this rank's shard of it when `p` is a DTensor."""
    full = make(tuple(p.shape))
    if isinstance(p, DTensor):
        full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    _local(p).copy_(full)


def _normal_rows(table: OwnerRoutedEmbedding, gen: torch.Generator, std: float) -> None:
    """Rows `[row_start, row_end)` of `torch.randn(rows, dim, generator=gen) * std`, drawn chunk by chunk."""
    dim = table.embedding_dim
    n = table.num_embeddings * dim
    lo, hi = table.row_start * dim, table.row_end * dim  # this rank's flat range
    dest = table.weight.detach().view(-1)
    a = 0
    while a < n:
        b = n if n - (a + _CHUNK) < 16 else a + _CHUNK  # the last draw keeps >= 16 values (randn's tail rule)
        values = torch.randn(b - a, generator=gen)
        s, e = max(a, lo), min(b, hi)
        if s < e:
            dest[s - lo : e - lo].copy_(values[s - a : e - a] * std)
        a = b


class LocalShardInit(WholeTensorInit):
    """`WholeTensorInit` that keeps only this rank's part of every draw: a DTensor's shard, an owner-routed
    table's rows."""

    def made(self, p: torch.Tensor, make) -> None:
        _fill(p, make)

    def const(self, p: torch.Tensor, value: float) -> None:
        _local(p).fill_(value)

    def module(self, m: nn.Module) -> bool:
        if isinstance(m, OwnerRoutedEmbedding):  # in the unsharded model: an nn.Embedding, drawn whole
            _normal_rows(m, self.gen, self.std)
            return True
        return False


@torch.no_grad()
def init_weights_local(model: nn.Module, seed: int) -> None:
    """`model.init_weights(seed)` for a model whose parameters are FSDP2 shards and/or owner-routed row ranges.

    Every rank must call it with the same seed (no collectives are issued). Derived buffers are recomputed with
    `model.reset_buffers()`.

    Args:
        model: a `FlashNextForCausalLM` after `parallelize` (materialised, i.e. not on `meta`).
        seed: the seed the unsharded model would be given.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    init_modules(model, LocalShardInit(gen, model.config.initializer_range))
