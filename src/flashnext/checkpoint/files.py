"""Reading safetensors files: locate them, read their headers, and stream tensors in bounded pieces.

Why the reader reopens files: `safe_open` memory-maps the whole file, and every page a copy touches stays
resident (and counted in RSS) until the map is closed. Reading a 10 GB shard through one handle would therefore
hold the destination parameters *and* the file's pages at once. `StreamReader` closes and reopens its handle
after `MAP_BUDGET_BYTES` have been read, and copies large tensors `CHUNK_BYTES` at a time, so loading costs
the destination bytes plus a few tens of MiB.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from flashnext.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 16 << 20
MAP_BUDGET_BYTES = 32 << 20
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header

# safetensors header dtype -> torch dtype (the ones torch can hold).
TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def is_float_dtype(dtype: str) -> bool:
    """True for safetensors' floating-point dtype names (`F32`, `BF16`, `F8_E4M3`, ...)."""
    return dtype.startswith("F") or dtype == "BF16"


def data_offsets(file: str | Path) -> tuple[int, dict[str, dict]]:
    """(byte offset of a safetensors file's data section, its JSON header `{key: {dtype, shape, data_offsets}}`).

    `data_offsets` in the header are relative to the data section; the `__metadata__` entry is included as is.
    """
    size = Path(file).stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or 8 + n > size:  # not a safetensors file (or cut inside its header): never read n bytes
            raise CheckpointError(f"{file}: {why_unreadable(Path(file), ValueError('bad header length'))}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: {why_unreadable(Path(file), e)}") from None
    return 8 + n, header


def why_unreadable(file: Path, error: Exception) -> str:
    """Why safetensors refused `file` (the caller names it), in the terms of its layout: a file shorter (or longer)
    than its header describes gives both sizes; a header that does not parse says so; else the library's message."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated: {size} bytes, not even the 8-byte header length of a safetensors file"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                return f"not a safetensors file: its first 8 bytes give a {n}-byte header (at most {MAX_HEADER_BYTES})"
            if 8 + n > size:
                return f"truncated: its header alone needs {8 + n} bytes, the file has {size}"
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        expected = 8 + n + max(ends, default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"not a safetensors file: its header does not parse ({type(error).__name__}: {error})"
    except OSError as e:
        return str(e)
    if size < expected:
        return f"truncated: its header describes {expected} bytes, the file has {size}"
    if size > expected:
        return f"corrupt: its header describes {expected} bytes, the file has {size}"
    return f"{type(error).__name__}: {error}"


def checkpoint_files(path: str | Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of a checkpoint and, for a sharded one, the index's `weight_map`.

    Args:
        path: a directory holding `model.safetensors` or `model.safetensors.index.json`, or one `.safetensors` file.

    Returns:
        (files, weight_map): `weight_map` maps each key to its file, or is None without an index.

    Raises:
        CheckpointError: no weights found, an unreadable index, or files the index names that do not exist.
    """
    path = Path(path)
    if path.is_file():
        return [path], None
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from e
        files = sorted({path / name for name in weight_map.values()})
        absent = [f"missing file: {f.name} (named by {INDEX_FILE})" for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"cannot load checkpoint {str(path)!r}", absent)
        return files, {k: path / v for k, v in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], None
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}")


def read_headers(files: list[Path], weight_map: dict[str, Path] | None):
    """Read every file's header (never tensor data).

    Returns:
        (headers, problems, lost): `headers` maps key -> (file, shape, dtype name); `problems` lists unreadable
        (truncated/corrupt) files by name and index entries their file lacks; `lost` holds the keys the index
        places in unreadable files (already reported through their file, so not "missing" as well).
    """
    headers: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    problems: list[str] = []
    unreadable: set[Path] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    headers[key] = (file, tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error type for corrupt/truncated files
            unreadable.add(file)
            problems.append(f"unreadable file: {file.name} ({why_unreadable(file, e)})")
    lost: set[str] = set()
    for key, file in (weight_map or {}).items():
        if file in unreadable:
            lost.add(key)
        elif headers.get(key, (None,))[0] != file:
            problems.append(f"index lists {key} in {file.name}, which lacks it")
    return headers, problems, lost


class StreamReader:
    """Copies tensors out of safetensors files in bounded pieces, remapping files as it goes (see module doc)."""

    def __init__(self):
        self._file: Path | None = None
        self._handle = None
        self._mapped = 0

    def _open(self, file: Path):
        if self._handle is None or self._file != file or self._mapped >= MAP_BUDGET_BYTES:
            self.close()
            self._handle = safe_open(file, framework="pt").__enter__()
            self._file, self._mapped = file, 0
        return self._handle

    def close(self) -> None:
        """Unmap the open file, if any."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._file, self._mapped = None, None, 0

    def read_small(self, file: Path, key: str) -> torch.Tensor:
        """A whole (small) tensor as stored: dtype and shape from the file."""
        tensor = self._open(file).get_tensor(key)
        self._mapped += tensor.nbytes
        return tensor

    def copy_into(self, file: Path, key: str, dest: torch.Tensor) -> None:
        """Copy `key` into `dest` (same shape), casting to `dest.dtype`, at most `CHUNK_BYTES` of rows at a time.

        Args:
            file: the safetensors file holding `key`.
            key: the tensor's name in `file`.
            dest: any view of an allocated tensor, e.g. `gate_up_proj[e, :I]`; `dest.shape` is `key`'s shape.
        """
        if dest.dim() == 0:
            dest.copy_(self.read_small(file, key))
            return
        rows = dest.shape[0]
        row_bytes = max(1, dest[0].numel() * dest.element_size())
        step = max(1, CHUNK_BYTES // row_bytes)
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            piece = self._open(file).get_slice(key)[start:stop]
            dest[start:stop].copy_(piece)
            self._mapped += piece.nbytes
            del piece

    def read_full(self, file: Path, key: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A new CPU tensor holding `key` in its stored dtype, read in bounded pieces."""
        if dtype not in TORCH_DTYPES or not shape:
            return self.read_small(file, key).clone()
        out = torch.empty(shape, dtype=TORCH_DTYPES[dtype])
        self.copy_into(file, key, out)
        return out
