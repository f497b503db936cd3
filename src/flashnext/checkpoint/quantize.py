"""`flashnext quantize --ngram fp8 IN OUT`: a checkpoint whose n-gram tables are in the official FP8 layout.

Each table `...ngram_embedding.shard_{j}.weight` (BF16/F16/F32) becomes `F8_E4M3` rows `rows / scale` with one
`...ngram_embedding.weight_scale` (F32, shape `[]`) per table, `scale = amax / 448` over the whole table (vLLM's
"one global checkpoint scale" format: the largest value maps to float8_e4m3fn's largest, 448). Every other tensor
is copied byte for byte; the files keep their names and tensors (the scale goes into the file of the table's first
shard), the index is rewritten, and every other file of the directory (config, tokenizer) is copied. OUT must be
absent or empty unless `overwrite` (`--overwrite`), which replaces it whole (`checkpoint.target`): no file of
what OUT held before survives beside the new checkpoint.

Streamed: two passes over each table (amax, then quantise) read `PIECE_BYTES` of rows at a time straight from
the files and write them with `stream_write`, so no table, nor any other tensor, is ever whole in memory (the
peak is a few pieces: the read rows, their fp32 quotient, the FP8 result).
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import INDEX_FILE, TORCH_DTYPES, checkpoint_files, data_offsets
from flashnext.checkpoint.fp8 import fp8_scale, quantize_fp8
from flashnext.checkpoint.ngram_tables import scale_key
from flashnext.checkpoint.stream_write import ITEM_BYTES, Entry, write_safetensors
from flashnext.checkpoint.target import check_target, writing
from flashnext.errors import CheckpointError

SCHEMES = ("fp8",)
PIECE_BYTES = 1 << 20
_SOURCE_DTYPES = ("BF16", "F16", "F32")


def _raw_chunks(file: Path, begin: int, end: int, step: int) -> Iterator[bytearray]:
    """Bytes [begin, end) of `file` in pieces of at most `step` bytes (each a new buffer the caller may keep)."""
    with open(file, "rb", buffering=0) as f:
        f.seek(begin)
        for a in range(begin, end, step):
            piece = bytearray(min(step, end - a))
            if f.readinto(piece) != len(piece):
                raise CheckpointError(f"{file.name}: truncated at byte {a} (expected data up to byte {end})")
            yield piece


def row_chunks(file: Path, base: int, info: dict) -> Iterator[torch.Tensor]:
    """A 2-D tensor's rows in pieces of about `PIECE_BYTES`, as tensors of its dtype (`info`: its header entry)."""
    rows, width = info["shape"]
    row_bytes = width * ITEM_BYTES[info["dtype"]]
    begin, end = info["data_offsets"]
    step = max(1, PIECE_BYTES // max(row_bytes, 1)) * row_bytes
    for piece in _raw_chunks(file, base + begin, base + end, step):
        yield torch.frombuffer(piece, dtype=TORCH_DTYPES[info["dtype"]]).view(-1, width)


def _tables(headers: dict[Path, tuple[int, dict]]) -> dict[str, list[tuple[Path, str]]]:
    """{table disk prefix: [(file, shard key) in shard order]} over every file."""
    found: dict[str, dict[int, tuple[Path, str]]] = defaultdict(dict)
    for file, (_, header) in headers.items():
        for key in header:
            if m := layout.NGRAM_SHARD.match(key):
                found[m["pre"]][int(m["j"])] = (file, key)
    return {pre: [shards[j] for j in sorted(shards)] for pre, shards in found.items()}


def _amax(headers: dict, shards: list[tuple[Path, str]]) -> float:
    amax = 0.0
    for file, key in shards:
        base, header = headers[file]
        info = header[key]
        if info["dtype"] not in _SOURCE_DTYPES:
            raise CheckpointError(f"cannot quantize {key}: it is {info['dtype']}, expected one of {_SOURCE_DTYPES}")
        for rows in row_chunks(file, base, info):
            if rows.numel():
                amax = max(amax, float(rows.float().abs().max()))
    return amax


def check_quantize_target(src: str | Path, dst: str | Path, overwrite: bool) -> tuple[Path, Path]:
    """`check_target` for a `flashnext quantize` writer, which reads the checkpoint `src` while it writes `dst`:
    also refuses `dst` equal to or holding `src`. Returns `(src, dst)` as paths.

    Raises:
        CheckpointError: `dst` equal to (or holding) `src`, or refused by `check_target`.
    """
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve() or dst.resolve() in src.resolve().parents:
        raise CheckpointError(f"quantize writes a new checkpoint: OUT must differ from IN ({str(src)!r}) and not "
                              "contain it")  # fmt: skip
    check_target(dst, overwrite)
    return src, dst


def quantize_checkpoint(
    src: str | Path, dst: str | Path, *, ngram: str = "fp8", overwrite: bool = False
) -> dict[str, float]:
    """Write `src` to `dst` with every n-gram table in FP8 (see the module doc); returns `{table prefix: scale}`.

    Raises:
        CheckpointError: an unknown scheme, `dst` equal to (or holding) `src`, `dst` not empty without `overwrite`,
            no n-gram table, or a table not in BF16/F16/F32.
    """
    if ngram not in SCHEMES:
        raise CheckpointError(f"--ngram {ngram!r}: expected one of {SCHEMES}")
    src, dst = check_quantize_target(src, dst, overwrite)
    files, weight_map = checkpoint_files(src)
    headers = {f: data_offsets(f) for f in files}
    tables = _tables(headers)
    if not tables:
        raise CheckpointError(f"{str(src)!r} has no n-gram table shards (...ngram_embedding.shard_*.weight)")
    scales = {pre: fp8_scale(_amax(headers, shards)) for pre, shards in tables.items()}
    scale_file = {pre: shards[0][0] for pre, shards in tables.items()}
    shard_scale = {key: scales[pre] for pre, shards in tables.items() for _, key in shards}
    with writing(dst, overwrite) as tmp:
        _write(src, tmp, files, weight_map, headers, scales, scale_file, shard_scale)
    return scales


def _write(src: Path, dst: Path, files, weight_map, headers, scales, scale_file, shard_scale) -> None:
    """Every file of `src` into the new directory `dst`, the n-gram shards quantised (see the module doc)."""
    new_map: dict[str, str] = {}
    total = 0
    for file in files:
        base, header = headers[file]
        meta = header.get("__metadata__")
        keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        entries = [_entry(file, base, k, header[k], shard_scale.get(k)) for k in keys]
        for pre, f in scale_file.items():
            if f == file:
                value = torch.tensor(scales[pre], dtype=torch.float32)
                entries.append(Entry(scale_key(pre), "F32", (), lambda v=value: [v]))
        total += write_safetensors(dst / file.name, entries, meta)
        new_map.update({e.key: file.name for e in entries})
    if weight_map is not None:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for other in src.iterdir() if src.is_dir() else []:
        if other.is_file() and other.suffix != ".safetensors" and other.name != INDEX_FILE:
            shutil.copy2(other, dst / other.name)


def _entry(file: Path, base: int, key: str, info: dict, scale: float | None) -> Entry:
    """A tensor copied byte for byte, or (with a scale) an n-gram shard quantised to F8_E4M3 chunk by chunk."""
    shape = tuple(info["shape"])
    if scale is None:
        begin, end = info["data_offsets"]
        return Entry(key, info["dtype"], shape, lambda: _raw_chunks(file, base + begin, base + end, PIECE_BYTES))
    return Entry(key, "F8_E4M3", shape, lambda: (quantize_fp8(r, scale) for r in row_chunks(file, base, info)))
