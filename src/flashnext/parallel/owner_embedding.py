"""Owner-routed, row-sharded embedding: each rank keeps a contiguous range of rows and looks up only those.

A dense embedding whose weight is row-sharded (e.g. a DTensor) still materialises the *full* table gradient on every
rank in backward; for a PLE n-gram table (320M x 160) that is ~95 GiB per rank. Here each id is routed to the rank
that owns its row instead, so the forward moves ids and vectors, never rows, and backward sends vector gradients
back to their owners: each rank's `.grad` is exactly its local rows.

Forward, on every rank of the group (legend: N local ids, U ids sent after dedup, R ids received, W world size):
  1. flatten ids [*S] -> [N]; deduplicate (`torch.unique`, sorted, so already ordered by owner) or sort them;
  2. count ids per owner [W] and exchange the counts with one equal-split all-to-all, which also carries each
     rank's first out-of-range id, so every rank raises together before any variable-split collective;
  3. send ids [U] to their owners with a variable-split all-to-all (one host copy of the counts sizes it);
  4. owners look up their received ids [R] in their local rows ([local_rows, dim], a plain `nn.Parameter`);
  5. send the vectors back with an autograd all-to-all (its backward is the reverse all-to-all) and restore the
     caller's order with the saved inverse index (gradients of duplicate ids are summed by that gather's backward).

Every rank of the group must call forward (and backward) the same number of times, as with any collective: a
rank with no tokens passes an empty id tensor, and its loss must still depend on the (empty) output.

The model package stays free of `torch.distributed`: `swap_ngram_embeddings` replaces its n-gram tables from
outside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flashnext.checkpoint.fp8 import dequantize_rows
from flashnext.errors import ConfigError, InputError
from flashnext.model.ngram import NGramEmbedding
from flashnext.ngram import StoredNGramTable, apply_keeping_storage

__all__ = ["OwnerRoutedEmbedding", "row_ranges", "swap_ngram_embeddings"]


def row_ranges(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` row range of each rank: the first `num_rows % world_size` ranks hold one extra row.

    Shards are empty only when `num_rows < world_size`.
    """
    base, extra = divmod(num_rows, world_size)
    ranges, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all along dim 0 whose backward is the reverse all-to-all.

    Written here rather than using `torch.distributed.nn.functional.all_to_all_single`, which does the same but is
    deprecated in torch 2.13 (it warns on every call).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


def _reject_options(padding_idx, max_norm, scale_grad_by_freq: bool, sparse: bool) -> None:
    rejected = {
        "padding_idx": (padding_idx is not None, padding_idx),
        "max_norm": (max_norm is not None, max_norm),
        "scale_grad_by_freq": (bool(scale_grad_by_freq), scale_grad_by_freq),
        "sparse": (bool(sparse), sparse),
    }
    for name, (bad, value) in rejected.items():
        if bad:
            raise ConfigError(
                f"OwnerRoutedEmbedding does not support {name}={value!r}: it needs statistics or rows of the whole "
                f"table, which no rank holds; use {name}={'None' if name in ('padding_idx', 'max_norm') else 'False'}"
            )


class OwnerRoutedEmbedding(nn.Module):
    """Embedding whose rows are split across `group`; ids are routed to the rank owning their row.

    Rank r holds rows `row_ranges(num_embeddings, world)[r]` as `weight: [local_rows, embedding_dim]`.

    Args:
        num_embeddings: rows of the whole table.
        embedding_dim: vector size.
        group: process group (default: the world group, which must be initialised).
        dedup: send each distinct id once per (rank, owner) and sum its gradients locally (default on).
        padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse: `nn.Embedding`'s options; only the defaults
            are accepted (a `ConfigError` names any other).
        device, dtype: of the local rows.

    Attributes:
        last_stats: counters of the last forward: `input_ids` (N), `sent_ids` (U), `received_ids` (R),
            `sent_per_peer` and `received_per_peer` (lists of W ints).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: dist.ProcessGroup | None = None,
        *,
        dedup: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        _reject_options(padding_idx, max_norm, scale_grad_by_freq, sparse)
        if num_embeddings < 0 or embedding_dim < 0:
            raise ConfigError(f"OwnerRoutedEmbedding needs sizes >= 0, got ({num_embeddings}, {embedding_dim})")
        if not dist.is_initialized():
            raise ConfigError("OwnerRoutedEmbedding needs an initialised torch.distributed process group")
        self.group = group
        self.num_embeddings, self.embedding_dim, self.dedup = num_embeddings, embedding_dim, dedup
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if self.rank < 0:
            raise ConfigError("OwnerRoutedEmbedding: this process is not a member of the given process group")
        self.ranges = row_ranges(num_embeddings, self.world_size)
        self.row_start, self.row_end = self.ranges[self.rank]
        local_rows = self.row_end - self.row_start
        self.weight = nn.Parameter(torch.empty(local_rows, embedding_dim, device=device, dtype=dtype))
        self.last_stats: dict = {}
        self.reset_parameters()

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, group: dist.ProcessGroup | None = None, *, dedup: bool = True
    ) -> OwnerRoutedEmbedding:
        """Owner-routed twin of `embedding` holding this rank's rows (copied unless the weight is on `meta`)."""
        _reject_options(embedding.padding_idx, embedding.max_norm, embedding.scale_grad_by_freq, embedding.sparse)
        w = embedding.weight
        new = cls(w.shape[0], w.shape[1], group, dedup=dedup, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":
            with torch.no_grad():
                new.weight.copy_(w[new.row_start : new.row_end])
        return new

    @classmethod
    def from_stored(
        cls, table: StoredNGramTable, group: dist.ProcessGroup | None = None, *, dedup: bool = True
    ) -> OwnerRoutedEmbedding:
        """Frozen owner-routed twin of a stored-dtype table (e.g. FP8 + scale): this rank's rows stay in the stored
        dtype as the buffer `weight`, `weight_scale` is kept whole, and owners dequantise the rows they gather
        (`dequantize_rows`) before sending them back in `table.dtype`. Nothing to train: no parameter, no gradient.
        """
        new = cls(table.num_embeddings, table.embedding_dim, group, dedup=dedup, device="meta")
        del new.weight  # the Parameter: a frozen table keeps its rows as a buffer in the stored dtype
        rows = table.weight[new.row_start : new.row_end]
        new.register_buffer("weight", rows if rows.device.type == "meta" else rows.clone())
        new.register_buffer("weight_scale", table.weight_scale)
        new.dtype = table.dtype
        return new

    @property
    def frozen(self) -> bool:
        """True for a stored-dtype table (`from_stored`): rows in a buffer, dequantised after the local gather."""
        return not isinstance(self.weight, nn.Parameter)

    def _apply(self, fn, recurse: bool = True):
        return apply_keeping_storage(self, fn) if self.frozen else super()._apply(fn, recurse)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, 1) like `nn.Embedding` (a model's own `init_weights` usually overrides it)."""
        if self.weight.device.type != "meta" and not self.frozen:
            nn.init.normal_(self.weight)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.row_start}, {self.row_end}) "
            f"of world {self.world_size}, dedup={self.dedup}"
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int32/int64 [*S] (any layout) -> [*S, embedding_dim] in the weight's dtype.

        Raises:
            InputError: on every rank of the group when any rank has an id outside `[0, num_embeddings)`; the
                message names the offending rank, id and position (a flat index into that rank's ids).
        """
        if ids.dtype not in (torch.int32, torch.int64):
            raise InputError(f"OwnerRoutedEmbedding ids must be int32 or int64, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self.weight.device, dtype=torch.long)  # [N]
        if self.dedup:
            send_ids, restore = torch.unique(flat, sorted=True, return_inverse=True)  # [U], [N]
        else:
            send_ids, order = torch.sort(flat, stable=True)
            restore = torch.empty_like(order)
            restore[order] = torch.arange(order.numel(), device=order.device)
        # Sorted ids are grouped by owner because shards are contiguous and in rank order.
        owners = self._owner(send_ids)
        send_counts = torch.bincount(owners, minlength=self.world_size)  # [W]
        send_splits, recv_splits = self._exchange_counts(flat, send_counts)
        recv_ids = _AllToAll.apply(send_ids, recv_splits, send_splits, self.group)  # [R]
        if self.frozen:  # stored rows (e.g. FP8): gather, then dequantise before they travel
            local = self.weight.index_select(0, recv_ids - self.row_start)
            vectors = dequantize_rows(local, self.weight_scale, self.dtype)  # [R, dim]
        else:
            vectors = F.embedding(recv_ids - self.row_start, self.weight)  # [R, dim]
        returned = _AllToAll.apply(vectors, send_splits, recv_splits, self.group)  # [U, dim]
        self.last_stats = {
            "input_ids": flat.numel(),
            "sent_ids": send_ids.numel(),
            "received_ids": recv_ids.numel(),
            "sent_per_peer": send_splits,
            "received_per_peer": recv_splits,
        }
        # index_select's backward is an index_add: duplicates' gradients are summed before they are sent back.
        return returned.index_select(0, restore).reshape(*ids.shape, self.embedding_dim)

    def _owner(self, ids: torch.Tensor) -> torch.Tensor:
        """Owning rank of each id (arithmetic on the `row_ranges` split, so no table of bounds to keep in sync)."""
        base, extra = divmod(self.num_embeddings, self.world_size)
        big = extra * (base + 1)  # rows held by the ranks with one extra row
        owner = torch.where(ids < big, ids // (base + 1), extra + (ids - big) // max(base, 1))
        return owner.clamp(0, self.world_size - 1)  # out-of-range ids are reported before they are sent

    def _exchange_counts(self, flat: torch.Tensor, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """One equal-split all-to-all of `[count for peer, bad flag, bad position, bad id]` and one host copy.

        Returns the per-peer send and receive splits, or raises on every rank if any rank had a bad id.
        """
        W = self.world_size
        bad = (flat < 0) | (flat >= self.num_embeddings)
        if flat.numel():  # flag, first bad position, its id; stays on the device (the one host copy is below)
            pos = torch.argmax(bad.to(torch.uint8))
            bad_info = torch.stack([bad.any().long(), pos, flat[pos]])
        else:
            bad_info = flat.new_zeros(3)
        message = torch.cat([send_counts[:, None], bad_info.expand(W, 3)], dim=1).contiguous()  # [W, 4]
        received = torch.empty_like(message)
        dist.all_to_all_single(received, message, group=self.group)
        host = torch.cat([send_counts, received.reshape(-1)]).tolist()
        send_splits, table = host[:W], [host[W + 4 * p : W + 4 * p + 4] for p in range(W)]
        offenders = [(p, row[2], row[3]) for p, row in enumerate(table) if row[1]]
        if offenders:
            where = "; ".join(f"rank {p}: id {i} at flat position {q}" for p, q, i in offenders)
            raise InputError(
                f"OwnerRoutedEmbedding ids must lie in [0, {self.num_embeddings}); out of range on {where} "
                f"(raised on every rank of the group)"
            )
        return send_splits, [row[0] for row in table]


def swap_ngram_embeddings(model: nn.Module, group: dist.ProcessGroup | None = None, *, dedup: bool = True) -> list[str]:
    """Replace every PLE n-gram table (`NGramEmbedding.ngram_embedding`) with an `OwnerRoutedEmbedding`.

    Each rank keeps only its rows, copied from the full table when that is materialised; on `meta` the new rows
    stay on `meta` for the caller to materialise and initialise. The full table is released with the old module.
    A frozen stored-dtype table (`StoredNGramTable`, e.g. FP8 + scale) becomes a frozen owner-routed one
    (`OwnerRoutedEmbedding.from_stored`). Tables read from disk (`ngram_storage="mmap"`) are left alone: every rank
    reads its own rows from the files.

    Returns:
        The qualified names of the replaced modules, e.g. `model.layers.2.ple.ple_embedding.ngram_embedding`.
    """
    swapped = []
    for name, module in list(model.named_modules()):
        if isinstance(module, NGramEmbedding) and isinstance(module.ngram_embedding, nn.Embedding):
            module.ngram_embedding = OwnerRoutedEmbedding.from_embedding(module.ngram_embedding, group, dedup=dedup)
            swapped.append(f"{name}.ngram_embedding")
        elif isinstance(module, NGramEmbedding) and isinstance(module.ngram_embedding, StoredNGramTable):
            module.ngram_embedding = OwnerRoutedEmbedding.from_stored(module.ngram_embedding, group, dedup=dedup)
            swapped.append(f"{name}.ngram_embedding")
    return swapped
