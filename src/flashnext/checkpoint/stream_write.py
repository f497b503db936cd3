"""Write a safetensors file tensor by tensor from byte chunks, never holding a whole tensor in memory.

`safetensors.torch.save_file` needs every tensor of the file alive at once; a quantised copy of a 100 GB table, or
a synthetic one, does not exist as a tensor. The format is simple enough to stream: an 8-byte little-endian header
length, a JSON header giving each tensor's dtype, shape and `[begin, end)` byte range in the data section, then
the data. The header is padded with spaces to a multiple of 8 bytes, as the reference writer does.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip


@dataclass
class Entry:
    """One tensor to write: `chunks()` yields its bytes in order (tensors, numpy arrays or bytes)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_BYTES[self.dtype]


def _as_bytes(chunk) -> memoryview:
    if isinstance(chunk, torch.Tensor):
        chunk = chunk.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(chunk, np.ndarray):
        chunk = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1)
    return memoryview(chunk).cast("B")


def write_safetensors(
    path: str | Path, entries: list[Entry], metadata: dict[str, str] | None = None, *, durable: bool = True
) -> int:
    """Write `entries` (in order) to `path`; returns the data bytes written. `durable` fsyncs the file.

    Raises:
        ValueError: a tensor's chunks do not add up to its `dtype` x `shape` size (the file is removed).
    """
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for e in entries:
                written = 0
                for chunk in e.chunks():
                    written += f.write(_as_bytes(chunk))
                if written != e.nbytes:
                    raise ValueError(f"{e.key}: wrote {written} bytes, {e.dtype} {list(e.shape)} needs {e.nbytes}")
            f.flush()
            if durable:
                os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return offset
