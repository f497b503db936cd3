"""How each PLE n-gram table is stored in a checkpoint.

On disk a table is `...ple_embedding.ngram_embedding.shard_{j}.weight` row chunks (or one whole
`...ngram_embedding.weight`, as `model.state_dict()` saves it) in one dtype: BF16/FP32 (or F16), or the official
FP8 layout: `F8_E4M3` shards plus one `...ngram_embedding.weight_scale` per table (a
single value, stored as F32, BF16 or F16 depending on the exporter; rows dequantise as `rows * scale`).
`F8_E5M2` shards and FP8 shards without their scale are refused.

Which module holds a table in memory (`ngram_storage=`) is `flashnext.ngram`'s: this file only maps the files
(`inspect_table` -> `TableOnDisk`) and finds the tables of a model by shape, not class.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from flashnext.checkpoint import layout

FP8 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
NGRAM_SCALE = re.compile(r"^(?P<pre>.+\.ple_embedding\.ngram_embedding)\.weight_scale$")
_SHARD_OF = re.compile(r"\.shard_(\d+)\.weight$")


def scale_key(disk_pre: str) -> str:
    """The scale's on-disk name for a table whose shards are `{disk_pre}.shard_{j}.weight`."""
    return f"{disk_pre}.weight_scale"


@dataclass(frozen=True)
class TableOnDisk:
    """One n-gram table as a checkpoint stores it.

    Attributes:
        our_key: our state_dict name of the table (`...ngram_embedding.weight`).
        disk_pre: its on-disk prefix (`...ngram_embedding`, in the checkpoint's naming).
        shards: `(key, file, shape, dtype)` of every shard, in shard order.
        dtype: the shards' safetensors dtype (`F8_E4M3`, `BF16`, `F32`, ...).
        scale: `(key, file, shape, dtype)` of the FP8 scale, or None.
    """

    our_key: str
    disk_pre: str
    shards: list[tuple[str, Path, tuple[int, ...], str]]
    dtype: str
    scale: tuple[str, Path, tuple[int, ...], str] | None

    @property
    def rows(self) -> int:
        return sum(s[2][0] for s in self.shards)


def fp8_problems(disk_pre: str, shard_dtypes: dict[str, str], headers: dict) -> list[str]:
    """Problems of one table's FP8 layout: E5M2 shards, a missing/bad scale, a scale beside non-FP8 shards.

    Args:
        disk_pre: the table's on-disk prefix.
        shard_dtypes: `{shard key: safetensors dtype}`.
        headers: every on-disk key -> (file, shape, dtype).
    """
    problems = [
        f"unsupported dtype: {k} is F8_E5M2; FP8 n-gram tables must be F8_E4M3 (float8_e4m3fn) with a weight_scale"
        for k, d in shard_dtypes.items()
        if d == "F8_E5M2"
    ]
    dtypes = sorted(set(shard_dtypes.values()))
    fp8 = FP8 in dtypes
    if len(dtypes) > 1:
        problems.append(f"wrong dtype: {disk_pre} shards mix dtypes {dtypes}; a table is stored in one dtype")
    key = scale_key(disk_pre)
    if fp8 and key not in headers:
        problems.append(f"missing: {key} (the F8_E4M3 n-gram table {disk_pre} needs its scale)")
    if key in headers:
        _, shape, dtype = headers[key]
        if dtype not in SCALE_DTYPES:
            problems.append(f"wrong dtype: {key} is {dtype}, expected one of {', '.join(SCALE_DTYPES)}")
        elif math.prod(shape) != 1 or len(shape) > 1:
            problems.append(f"mis-shaped: {key} is {list(shape)}, expected one value ([] or [1])")
        elif not fp8 and "F8_E5M2" not in dtypes:  # E5M2 shards are the problem there, reported above
            problems.append(f"unexpected: {key} (a scale, but the table {disk_pre} is {dtypes}, not {FP8})")
    return problems


def inspect_table(our_key: str, style: str, headers: dict) -> tuple[TableOnDisk | None, list[str]]:
    """The on-disk form of our table `our_key` and its FP8 problems; None when the checkpoint has no rows of it.

    Shards `...shard_{j}.weight` or, failing those, the whole `...ngram_embedding.weight` (one shard of all rows).
    """
    disk_pre = layout.to_disk_name(our_key.removesuffix(".weight"), style)
    found = {}
    for key in headers:
        if key.startswith(disk_pre + ".shard_") and (m := _SHARD_OF.search(key)) and layout.NGRAM_SHARD.match(key):
            found[int(m[1])] = key
    if not found and f"{disk_pre}.weight" in headers:
        found[0] = f"{disk_pre}.weight"
    if not found:
        return None, []
    shards = [(found[j], *headers[found[j]]) for j in sorted(found)]
    dtypes = {k: d for k, _, _, d in shards}
    problems = fp8_problems(disk_pre, dtypes, headers)
    key = scale_key(disk_pre)
    scale = (key, *headers[key]) if key in headers else None
    return TableOnDisk(our_key, disk_pre, shards, shards[0][3], scale), problems


def ngram_tables(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(our table name `...ngram_embedding.weight`, the `NGramEmbedding` owning it) for every PLE table.

    By shape, not class (this package reads and writes tensors by name and imports no model class): the module
    that hashes ids (`hash_ids`) and owns the `ngram_embedding` lookup."""
    return [
        (f"{n}.ngram_embedding.weight", m)
        for n, m in model.named_modules()
        if hasattr(m, "hash_ids") and hasattr(m, "ngram_embedding")
    ]


def external_keys(model: nn.Module) -> set[str]:
    """On-disk keys read by tables themselves (an `NgramTable`'s `disk_keys`: `mmap`, `nf4`): the loader leaves
    them alone."""
    keys: set[str] = set()
    for m in model.modules():
        keys |= set(getattr(m, "disk_keys", ()))
    return keys
