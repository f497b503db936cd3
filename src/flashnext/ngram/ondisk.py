"""An n-gram table served from its checkpoint files (`ngram_storage="mmap"`): rows read on demand, a bounded cache.

The table never enters memory as a tensor. A lookup reads exactly its rows from the safetensors shards (byte
offsets from the headers) with `pread`, one call per run of consecutive rows, and converts them like every
other table (`checkpoint.fp8.dequantize_rows`), so the values are bitwise those of the in-memory table.
Recently read rows are kept in a direct-mapped cache of `resident_mb` MiB (slot `id % slots`, a newer row evicts
the older one), so the table's resident bytes can never exceed the budget.

Why `pread` and not a memory map: every page a lookup touches through a map stays mapped, and counted in RSS,
until it is unmapped, so a long generation over a random-access table creeps toward the whole table (SGLang saw
this streaming the 47.7 GiB FP8 table and added a periodic `madvise(MADV_DONTNEED)` above a budget). Accounting
for the pages a map makes resident is not possible from user space with any precision: one read fault maps a
whole page-cache folio (measured on Linux 6.18: about 2 MB per 32-byte row), so a budget enforced by counting
touched pages is off by up to 512x and one decode step can map hundreds of MB. `pread` copies only the row into
our buffer; the file pages live in the kernel's page cache, which is reclaimable and not the process's RSS
(llama.cpp's on-disk mode does the same). From the page cache a row costs about 1 us. `POSIX_FADV_RANDOM`
turns off readahead: a miss reads from disk only the pages holding the row.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import TORCH_DTYPES, data_offsets
from flashnext.checkpoint.fp8 import dequantize_rows
from flashnext.checkpoint.ngram_tables import TableOnDisk
from flashnext.errors import CheckpointError, InputError
from flashnext.ngram.table import NgramTable

DEFAULT_RESIDENT_MB = 256
# Stored dtype -> the numpy dtype of the same width that carries its bits (numpy has no bf16/fp8).
_NP_CARRIER = {"F8_E4M3": np.uint8, "BF16": np.uint16, "F16": np.float16, "F32": np.float32}


class _Shard:
    """One shard's rows: an open file and the byte offset of row 0."""

    def __init__(self, file: Path, key: str, rows: int):
        base, header = data_offsets(file)
        self.file, self.key, self.rows = Path(file), key, rows
        self.start = base + header[key]["data_offsets"][0]
        self.fd = os.open(file, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, local: np.ndarray, out: np.ndarray) -> None:
        """out[i] = row local[i] (sorted, distinct), one `preadv` per run of consecutive rows."""
        row_bytes = out.shape[1] * out.itemsize
        view = memoryview(out.reshape(-1).view(np.uint8))
        breaks = (np.flatnonzero(np.diff(local) != 1) + 1).tolist()
        for a, b in zip([0, *breaks], [*breaks, local.size], strict=True):
            want = (b - a) * row_bytes
            got = os.preadv(self.fd, [view[a * row_bytes : b * row_bytes]], self.start + int(local[a]) * row_bytes)
            if got != want:
                raise CheckpointError(
                    f"{self.file.name}: {self.key} rows {int(local[a])}.. are truncated ({got}/{want} B)"
                )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class OnDiskNGramTable(NgramTable):
    """An `NgramTable` (storage `"mmap"`) that reads its rows from the checkpoint files on each lookup.

    Frozen: no parameters or buffers (nothing of it is in `state_dict`; `save_pretrained` copies the rows from the
    files, `saved_entries`). Model dtype casts change the output dtype only.

    Args:
        table: the table's on-disk form (`checkpoint.ngram_tables.inspect_table`), already validated.
        rows, width: the table shape the model expects (R, d).
        dtype: dtype of the looked-up rows.
        resident_mb: MiB of rows cached in memory (0: none, every lookup reads the files).

    Attributes:
        disk_keys: the on-disk keys this table reads (the loader skips them).
        rows_read, cache_hits: counters over all lookups (rows read from the files, rows served from the cache).
    """

    storage = "mmap"

    def __init__(self, table: TableOnDisk, rows: int, width: int, *, dtype: torch.dtype, resident_mb: float = 0):
        super().__init__()
        if table.dtype not in _NP_CARRIER:
            raise CheckpointError(f"cannot read {table.disk_pre}.shard_* from disk: dtype {table.dtype} is not served")
        bad = [f"{k} is {list(s)}" for k, _, s, _ in table.shards if len(s) != 2 or s[1] != width]
        if bad or table.rows != rows:
            raise CheckpointError(
                f"cannot read {table.disk_pre}.shard_* from disk: expected [{rows}, {width}] in all, the shards hold "
                f"{table.rows} rows", bad
            )  # fmt: skip
        self.num_embeddings, self.embedding_dim, self.dtype = rows, width, dtype
        self.table, self.stored_dtype = table, TORCH_DTYPES[table.dtype]
        self.carrier = _NP_CARRIER[table.dtype]
        self.shards = [_Shard(file, key, shape[0]) for key, file, shape, _ in table.shards]
        self.starts = np.cumsum([0] + [s.rows for s in self.shards])
        self.scale = None
        if table.scale is not None:
            from safetensors import safe_open

            with safe_open(table.scale[1], framework="pt") as f:
                self.scale = f.get_tensor(table.scale[0]).clone()
        self.disk_keys = frozenset([k for k, *_ in table.shards] + ([table.scale[0]] if table.scale else []))
        self._init_cache(rows, width, resident_mb)
        self.rows_read = self.cache_hits = 0

    def _init_cache(self, rows: int, width: int, resident_mb: float) -> None:
        """`tags [slots]` (the id held by each slot, -1: none) and `cache [slots, d]`, within `resident_mb` MiB.

        The rows live in an anonymous mapping: a slot costs memory only once a row is written to it, one page at a
        time (numpy's own large arrays are madvised to huge pages, so a single row would make 2 MiB resident).
        """
        row_bytes = width * np.dtype(self.carrier).itemsize
        slots = min(rows, int((resident_mb or 0) * (1 << 20)) // (row_bytes + 8))  # 8: the slot's tag
        self.tags = np.full(slots, -1, dtype=np.int64)
        self._cache_memory = mmap.mmap(-1, max(1, slots * row_bytes))
        self.cache = np.frombuffer(self._cache_memory, self.carrier, slots * width).reshape(slots, width)

    @torch.compiler.disable  # host I/O and numpy: runs outside compiled graphs (as vLLM runs its on-disk gather)
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
        raw = self._rows(uniq)
        rows = torch.from_numpy(raw).view(self.stored_dtype)
        out = dequantize_rows(rows, self.scale, self.dtype).index_select(0, torch.from_numpy(inverse).reshape(-1))
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _rows(self, uniq: np.ndarray) -> np.ndarray:
        """Stored rows [U, d] of the sorted distinct ids `uniq`: cached ones copied, the rest read and cached."""
        out = np.empty((uniq.size, self.embedding_dim), dtype=self.carrier)
        miss = np.ones(uniq.size, dtype=bool)
        if self.tags.size:
            slot = uniq % self.tags.size
            miss = self.tags[slot] != uniq
            out[~miss] = self.cache[slot[~miss]]
        missing = uniq[miss]
        got = np.empty((missing.size, self.embedding_dim), dtype=self.carrier)
        bounds = np.searchsorted(missing, self.starts)
        for j, shard in enumerate(self.shards):
            if bounds[j] < bounds[j + 1]:
                shard.read(missing[bounds[j] : bounds[j + 1]] - self.starts[j], got[bounds[j] : bounds[j + 1]])
        out[miss] = got
        if self.tags.size and missing.size:
            slot = missing % self.tags.size
            self.tags[slot], self.cache[slot] = missing, got  # ids sharing a slot: the last one stays
        self.rows_read += int(missing.size)
        self.cache_hits += int(uniq.size - missing.size)
        return out

    def rows_between(self, a: int, b: int) -> torch.Tensor:
        """Stored rows [a, b) in the stored dtype, for saving: a read-only map of the file when one shard holds
        them (its pages are released when the tensor is freed), else a concatenation."""
        j = int(np.searchsorted(self.starts, a, side="right")) - 1
        if b > self.starts[j + 1]:
            mid = int(self.starts[j + 1])
            return torch.cat([self.rows_between(a, mid), self.rows_between(mid, b)])
        shard, row_bytes = self.shards[j], self.embedding_dim * np.dtype(self.carrier).itemsize
        begin = shard.start + (a - int(self.starts[j])) * row_bytes
        aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
        if b == a:
            return torch.empty(0, self.embedding_dim, dtype=self.stored_dtype)
        mapped = mmap.mmap(shard.fd, begin - aligned + (b - a) * row_bytes, access=mmap.ACCESS_READ, offset=aligned)
        rows = np.frombuffer(mapped, self.carrier, (b - a) * self.embedding_dim, begin - aligned)
        with warnings.catch_warnings():  # read-only memory: the tensor is only ever read (written to a file)
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(rows.reshape(b - a, self.embedding_dim)).view(self.stored_dtype)

    @property
    def nbytes(self) -> int:
        """The row cache's bytes (rows and tags): the most this table ever holds in memory."""
        return self.cache.nbytes + self.tags.nbytes

    def saved_entries(self, name: str, style: str, parts: int, directory: Path) -> list[tuple[str, torch.Tensor]]:
        """(disk key, stored rows) of this table cut into `parts` shards, plus its scale, for saving.

        Raises:
            CheckpointError: `directory` holds a file this table reads (saving would overwrite the rows being read).
        """
        if any(s.file.resolve().parent == Path(directory).resolve() for s in self.shards):
            raise CheckpointError(f"cannot save into {str(directory)!r}: {name} reads its rows from files there")
        out = []
        shape = (self.num_embeddings, self.embedding_dim)
        for slot in layout.slots_for(f"{name}.weight", shape, style=style, split_ngram_parts=parts):
            out.append((slot.disk_key, self.rows_between(slot.index[0].start, slot.index[0].stop)))
        if self.scale is not None:
            out.append((layout.to_disk_name(f"{name}.weight_scale", style), self.scale))
        return out

    def __del__(self):
        for shard in getattr(self, "shards", []):
            shard.close()

    def extra_repr(self) -> str:
        cache = self.nbytes / 2**20
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, {self.table.dtype} read from {len(self.shards)} file "
            f"shard(s), row cache {cache:g} MiB -> {self.dtype}"
        )

