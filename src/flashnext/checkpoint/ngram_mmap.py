"""An n-gram table served from its checkpoint files: memory-mapped rows under a resident budget.

The table never enters memory as a tensor. Each shard's byte range (offsets from the safetensors header) is
mapped read-only; a lookup gathers exactly its rows with one numpy fancy index per shard, then converts them like
every other table (`model.ngram_table.dequantize_rows`), so the values are bitwise those of the in-memory table.

Why a budget: every page a lookup touches stays mapped, and counted in RSS, until it is unmapped, so a long
generation over a random-access table creeps toward the whole table (SGLang saw this streaming the 47.7 GiB FP8
table). Here the pages that can be resident are *counted* as lookups touch them, and before a lookup would push
the count past the budget the mappings are dropped with `madvise(MADV_DONTNEED)` (the pages stay in the page
cache, so faulting them back is cheap; only the process's share goes). The count is an upper bound: a read fault
may also map up to `FAULT_AROUND_BYTES` of neighbouring cached pages (the kernel's fault-around), so the unit of
account is that aligned window of the virtual address space, not the page. Lookups larger than the budget are
served in pieces with drops in between, so resident table bytes never exceed the budget (plus one window).
`MADV_RANDOM` turns off readahead: a miss reads one page from disk, not a cluster.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from flashnext.checkpoint.files import TORCH_DTYPES, data_offsets
from flashnext.checkpoint.ngram_tables import TableOnDisk
from flashnext.errors import CheckpointError, InputError
from flashnext.model.ngram_table import dequantize_rows

FAULT_AROUND_BYTES = 64 << 10  # Linux's default fault_around_bytes: what one read fault may map at most
DEFAULT_RESIDENT_MB = 512
# Stored dtype -> the numpy dtype of the same width that carries its bits (numpy has no bf16/fp8).
_NP_CARRIER = {"F8_E4M3": np.uint8, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class _MappedShard:
    """One shard's rows `[rows, d]` as a read-only numpy view of a private mapping of its byte range."""

    def __init__(self, file: Path, key: str, width: int, carrier):
        base, header = data_offsets(file)
        begin, end = header[key]["data_offsets"]
        start = base + begin
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        fd = os.open(file, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, end - begin + start - aligned, access=mmap.ACCESS_READ, offset=aligned)
        finally:
            os.close(fd)
        self.map.madvise(mmap.MADV_RANDOM)
        row_bytes = width * np.dtype(carrier).itemsize
        self.rows = np.frombuffer(self.map, carrier, (end - begin) // np.dtype(carrier).itemsize, start - aligned)
        self.rows = self.rows.reshape(-1, width)
        self.addr, self.row_bytes = self.rows.ctypes.data, row_bytes
        first = self.addr // FAULT_AROUND_BYTES
        self.first_window = first
        self.touched = np.zeros((self.addr + len(self.map)) // FAULT_AROUND_BYTES - first + 2, dtype=bool)

    def windows(self, local: np.ndarray) -> np.ndarray:
        """Distinct fault-around windows (indices into `touched`) the rows `local` lie in."""
        lo = (self.addr + local * self.row_bytes) // FAULT_AROUND_BYTES
        hi = (self.addr + (local + 1) * self.row_bytes - 1) // FAULT_AROUND_BYTES
        return np.unique(np.concatenate([lo, hi])) - self.first_window

    def drop(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED)
        self.touched[:] = False


class MmapNGramTable(nn.Module):
    """Drop-in for an n-gram table module (`forward(ids [*S]) -> rows [*S, d]`) that reads rows from the files.

    Frozen (no parameters, no buffers: nothing of it is in `state_dict`; `save_pretrained` copies the rows
    from the files). Model dtype casts change the output dtype only.

    Args:
        table: the table's on-disk form (`checkpoint.ngram_tables.inspect_table`), already validated.
        rows, width: the table shape the model expects (R, d).
        dtype: dtype of the looked-up rows.
        resident_mb: most MiB of the table's mapped pages kept resident (None: no limit).

    Attributes:
        disk_keys: the on-disk keys this table reads (the loader skips them).
        drops: how many times the mappings were dropped to keep within the budget.
    """

    def __init__(self, table: TableOnDisk, rows: int, width: int, *, dtype: torch.dtype, resident_mb=None):
        super().__init__()
        if table.dtype not in _NP_CARRIER:
            raise CheckpointError(f"cannot memory-map {table.disk_pre}.shard_*: dtype {table.dtype} is not served")
        bad = [f"{k} is {list(s)}" for k, _, s, _ in table.shards if len(s) != 2 or s[1] != width]
        if bad or table.rows != rows:
            raise CheckpointError(
                f"cannot memory-map {table.disk_pre}.shard_*: expected [{rows}, {width}] in all, shards hold "
                f"{table.rows} rows", bad
            )  # fmt: skip
        self.num_embeddings, self.embedding_dim, self.dtype = rows, width, dtype
        self.stored_dtype = TORCH_DTYPES[table.dtype]
        self.table = table
        carrier = _NP_CARRIER[table.dtype]
        self.shards = [_MappedShard(file, key, width, carrier) for key, file, _, _ in table.shards]
        self.starts = np.cumsum([0] + [s.rows.shape[0] for s in self.shards])
        self.scale = None
        if table.scale is not None:
            from safetensors import safe_open

            with safe_open(table.scale[1], framework="pt") as f:
                self.scale = f.get_tensor(table.scale[0]).clone()
        self.disk_keys = frozenset([k for k, *_ in table.shards] + ([table.scale[0]] if table.scale else []))
        self.budget = None if resident_mb is None else max(1, int(resident_mb * (1 << 20)) // FAULT_AROUND_BYTES)
        self.used, self.drops = 0, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int [*S] -> [*S, d] in `self.dtype`, on `ids.device`.

        Raises:
            InputError: an id outside `[0, rows)` (naming it and its flat position).
        """
        flat = ids.reshape(-1).to("cpu", torch.long).numpy()
        uniq, inverse = np.unique(flat, return_inverse=True)  # sorted: each shard's ids are one run
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= self.num_embeddings):
            bad = int(np.flatnonzero((flat < 0) | (flat >= self.num_embeddings))[0])
            raise InputError(f"n-gram id {int(flat[bad])} at flat position {bad} is outside [0, {self.num_embeddings})")
        raw = np.empty((uniq.size, self.embedding_dim), dtype=self.shards[0].rows.dtype) if self.shards else None
        bounds = np.searchsorted(uniq, self.starts)
        for j, shard in enumerate(self.shards):
            if bounds[j] < bounds[j + 1]:
                self._gather(shard, uniq[bounds[j] : bounds[j + 1]] - self.starts[j], raw[bounds[j] : bounds[j + 1]])
        rows = torch.from_numpy(raw).view(self.stored_dtype)
        out = dequantize_rows(rows, self.scale, self.dtype).index_select(0, torch.from_numpy(inverse).reshape(-1))
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _gather(self, shard: _MappedShard, local: np.ndarray, out: np.ndarray) -> None:
        """out[i] = shard row local[i] (sorted, distinct), dropping mappings first whenever the budget is full."""
        step = local.size if self.budget is None else max(1, self.budget // 2)  # a row spans <= 2 windows
        for a in range(0, local.size, step):
            part = local[a : a + step]
            if self.budget is not None:
                windows = shard.windows(part)
                new = windows[~shard.touched[windows]]
                if self.used + new.size > self.budget:
                    self.drop()
                    new = windows
                shard.touched[new] = True
                self.used += new.size
            out[a : a + step] = shard.rows[part]

    def drop(self) -> None:
        """Unmap every resident page of the table (they stay in the page cache)."""
        for shard in self.shards:
            shard.drop()
        self.used = 0
        self.drops += 1

    def rows_between(self, a: int, b: int) -> torch.Tensor:
        """Stored rows [a, b) as a tensor in the stored dtype: a view of the mapping when one shard holds them."""
        j = int(np.searchsorted(self.starts, a, side="right")) - 1
        if b <= self.starts[j + 1]:
            with warnings.catch_warnings():  # read-only memory: the tensor is only ever read (written to a file)
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                part = torch.from_numpy(self.shards[j].rows[a - self.starts[j] : b - self.starts[j]])
            return part.view(self.stored_dtype)
        return torch.cat([self.rows_between(a, int(self.starts[j + 1])), self.rows_between(int(self.starts[j + 1]), b)])

    def _apply(self, fn, recurse: bool = True):
        # No tensors to move; a model-wide dtype cast (`model.to(torch.bfloat16)`) sets the output dtype.
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def extra_repr(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget * FAULT_AROUND_BYTES / 2**20:g} MiB"
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, memory-mapped {self.table.dtype} from "
            f"{len(self.shards)} shard(s), {budget} -> {self.dtype}"
        )


def mapped_table_entries(model: nn.Module, style: str, parts: int, directory: Path) -> list[tuple[str, torch.Tensor]]:
    """(disk key, stored rows) of every memory-mapped table, cut into `parts` shards, plus its scale, for saving.

    Raises:
        CheckpointError: `directory` holds a file a table reads (saving would overwrite the rows being read).
    """
    from flashnext.checkpoint import layout

    out = []
    for name, table in model.named_modules():
        if not isinstance(table, MmapNGramTable):
            continue
        sources = {Path(f).resolve() for _, f, _, _ in table.table.shards}
        if any(f.parent == Path(directory).resolve() for f in sources):
            raise CheckpointError(f"cannot save into {str(directory)!r}: {name} is memory-mapped from files there")
        shape = (table.num_embeddings, table.embedding_dim)
        for slot in layout.slots_for(f"{name}.weight", shape, style=style, split_ngram_parts=parts):
            out.append((slot.disk_key, table.rows_between(slot.index[0].start, slot.index[0].stop)))
        if table.scale is not None:
            out.append((layout.to_disk_name(f"{name}.weight_scale", style), table.scale))
    return out


def drop_mapped_pages(model: nn.Module) -> None:
    """Unmap the resident pages of every memory-mapped table (e.g. after `save_pretrained` read them all)."""
    for m in model.modules():
        if isinstance(m, MmapNGramTable):
            m.drop()
