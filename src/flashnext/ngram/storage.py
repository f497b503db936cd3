"""Which `NgramTable` holds each PLE table of a model being loaded (`from_pretrained(..., ngram_storage=...)`).

Storage modes, chosen per table while the model is still on `meta`, before it is allocated:
- `auto`: FP8 tables stay FP8 in memory (`StoredNGramTable`, frozen), any other table is an `nn.Embedding` in
  the model dtype (trainable);
- `dense`: every table is an `nn.Embedding` in the model dtype; FP8 shards are upcast one shard at a time while
  loading (`rows.to(dtype) * scale.to(dtype)`, so never the whole table twice) - the trainable path;
- `stored`: every table stays in its stored dtype (FP8 + scale, BF16, FP32), frozen, rows converted after the
  gather;
- `nf4`: every table quantised to 4-bit codes + an fp16 scale per row while loading, shard by shard (lossy,
  frozen, in memory only: `ngram/nf4.py`);
- `mmap`: the rows stay in the checkpoint files; each lookup reads only its rows (with `pread`; a memory map
  would creep toward the whole table in RSS), and a row cache of at most `resident_mb` MiB keeps hot rows
  (`ngram/ondisk.py`).
All but `nf4` give the same looked-up values for the same checkpoint (bitwise: same rows, same conversion). How a
table is laid out in the files is `checkpoint/ngram_tables.py`'s (`TableOnDisk`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from flashnext.checkpoint.files import TORCH_DTYPES, checkpoint_files, data_offsets, read_headers
from flashnext.checkpoint.fp8 import dequantize_rows
from flashnext.checkpoint.ngram_tables import FP8, TableOnDisk, inspect_table, ngram_tables
from flashnext.checkpoint.quantize import row_chunks
from flashnext.errors import CheckpointError
from flashnext.ngram.nf4 import NF4NGramTable
from flashnext.ngram.ondisk import OnDiskNGramTable
from flashnext.ngram.stored import StoredNGramTable

STORAGES = ("auto", "dense", "stored", "mmap", "nf4")


def prepare_ngram_storage(
    model: nn.Module, path: str | Path, storage: str, *, dtype: torch.dtype, style: str, resident_mb: float
) -> None:
    """Swap each table module of a model still on `meta` for the one `storage` asks for (see the module doc).

    Call after the model's dtype cast and before `to_empty`: a `StoredNGramTable` keeps its stored dtype and
    is allocated by `to_empty`; an on-disk (`mmap`) table allocates nothing. Tables with problems keep their
    `nn.Embedding`, so `load_checkpoint` reports every problem in one error (an on-disk table is never
    read by the loader, so for `mmap` its problems are raised here).

    Raises:
        CheckpointError: an unknown `storage`, or (for `mmap`) a table the files cannot serve.
    """
    if storage not in STORAGES:
        raise CheckpointError(f"ngram_storage={storage!r}: expected one of {STORAGES}")
    if storage == "dense":
        return

    files, weight_map = checkpoint_files(path)
    headers, unreadable, lost = read_headers(files, weight_map)
    for our_key, ngram in ngram_tables(model):
        table, problems = inspect_table(our_key, style, headers)
        rows, width = ngram.ngram_embedding.weight.shape
        if storage in ("mmap", "nf4"):  # tables the loader never reads: their problems are raised here
            if table is None and unreadable:  # its rows may be in a file that cannot be read: name that file
                raise CheckpointError(f"ngram_storage={storage!r}: cannot read {our_key} from {str(path)!r}",
                                      unreadable)  # fmt: skip
            if table is None:
                raise CheckpointError(f"ngram_storage={storage!r}: no n-gram table rows of {our_key} in {str(path)!r}")
            if problems:
                raise CheckpointError(f"ngram_storage={storage!r}: cannot read {our_key} from {str(path)!r}", problems)
        if storage == "mmap":
            ngram.ngram_embedding = OnDiskNGramTable(table, rows, width, dtype=dtype, resident_mb=resident_mb)
        elif storage == "nf4":
            ngram.ngram_embedding = _nf4_table(table, rows, width, dtype)
        elif table is not None and not problems and (storage == "stored" or table.dtype == FP8):
            if table.dtype not in TORCH_DTYPES or any(s[0] in lost for s in table.shards):
                continue  # unreadable: the loader reports it
            scale = table.scale
            ngram.ngram_embedding = StoredNGramTable(
                rows, width, storage_dtype=TORCH_DTYPES[table.dtype], dtype=dtype,
                scale_dtype=TORCH_DTYPES[scale[3]] if scale else None, scale_shape=scale[2] if scale else (),
                device="meta",
            )  # fmt: skip


def _nf4_table(table: TableOnDisk, rows: int, width: int, dtype: torch.dtype) -> NF4NGramTable:
    """An `NF4NGramTable` on `meta`, filled after allocation by `fill_quantized_tables` from `table`'s files."""
    if table.rows != rows or any(len(s[2]) != 2 or s[2][1] != width for s in table.shards):
        raise CheckpointError(
            f"ngram_storage='nf4': {table.disk_pre} holds {table.rows} rows, expected [{rows}, {width}]"
        )
    module = NF4NGramTable(rows, width, dtype=dtype, device="meta")
    module.source = table
    module.disk_keys = frozenset([s[0] for s in table.shards] + ([table.scale[0]] if table.scale else []))
    return module


@torch.no_grad()
def fill_quantized_tables(model: nn.Module) -> None:
    """Quantise the stored rows of every NF4 table (`ngram_storage="nf4"`) into it, a 1 MiB piece at a time.

    FP8 rows are dequantised with their scale first (`dequantize_rows` to fp32), other dtypes cast to fp32.
    """
    for module in model.modules():
        if not isinstance(module, NF4NGramTable) or module.source is None:
            continue
        table = module.source
        scale = None
        if table.scale is not None:
            with safe_open(table.scale[1], framework="pt") as f:
                scale = f.get_tensor(table.scale[0])
        start = 0
        for key, file, _, _ in table.shards:
            base, header = data_offsets(file)
            for rows in row_chunks(file, base, header[key]):
                module.fill(start, dequantize_rows(rows, scale, torch.float32))
                start += rows.shape[0]
