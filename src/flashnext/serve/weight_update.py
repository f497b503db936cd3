"""Weight updates of a serving model from a trainer: tensors copied in place, by name, one piece at a time.

A piece is a tensor, or rows `[start, start + n)` of one along dim 0 (how an n-gram table travels: by row shard,
each trainer rank sending the rows it owns, never the whole table; large tensors are cut the same way so a receiver
buffers at most one piece). `copy_pieces` copies pieces into the model's parameters and buffers with `copy_`, so no
model-sized copy is ever made; the fused serving weights (`model/fused.py`) notice the in-place change (version
counter) and rebuild on their next use.

The wire format of a streamed update (the admin endpoint of `flashnext serve`, `flashnext.rl.weights`), one frame per
piece, back to back in one HTTP body:
    uint32 little-endian header length | header (UTF-8 JSON) | payload
with the header `{"name": str, "dtype": str, "shape": [int, ...], "start": int}` (dtype a torch dtype name such as
`float32`, `bfloat16`, `float8_e4m3fn`; `start` the first row along dim 0) and the payload the piece's bytes,
C-contiguous, `prod(shape) * itemsize` of them. `FrameReader` parses a body fed in arbitrary chunks and yields each
piece as soon as its last byte arrives, holding at most one piece.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from flashnext.errors import InputError

_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 16
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}  # fmt: skip


class WeightPiece(NamedTuple):
    """Rows `[start, start + tensor.shape[0])` of the model tensor `name` (start 0 and the full shape: all of it)."""

    name: str
    tensor: torch.Tensor
    start: int = 0


def weight_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by its state-dict name (what a piece's `name` refers to)."""
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


@torch.no_grad()
def copy_piece(targets: dict[str, torch.Tensor], piece: WeightPiece) -> int:
    """Copy one piece into its target in place (cast to the target's dtype); returns the bytes written.

    Raises:
        InputError: naming the tensor when it is unknown, or the piece's rows or shape do not fit it.
    """
    name, src, start = piece
    dst = targets.get(name)
    if dst is None:
        raise InputError(f"weight update: the model has no tensor {name!r}")
    if dst.dtype.itemsize == 1 and dst.is_floating_point() and src.dtype != dst.dtype:
        raise InputError(f"weight update: {name} is stored as {dst.dtype}; send it in that dtype, got {src.dtype}")
    if dst.dim() == 0 or src.dim() == 0:
        rows = dst
        if start or src.shape != dst.shape:
            raise InputError(f"weight update: {name} is a scalar; got shape {tuple(src.shape)} at row {start}")
    else:
        stop = start + src.shape[0]
        if start < 0 or stop > dst.shape[0] or src.shape[1:] != dst.shape[1:]:
            raise InputError(
                f"weight update: {name} has shape {tuple(dst.shape)}; rows [{start}, {stop}) of shape "
                f"{tuple(src.shape)} do not fit it"
            )
        rows = dst[start:stop]
    rows.copy_(src)
    return rows.numel() * rows.element_size()


def copy_pieces(model: nn.Module, pieces: Iterable[WeightPiece | tuple]) -> tuple[int, int]:
    """Copy every piece into `model` in order; returns (pieces, bytes). See `copy_piece` for the errors."""
    targets = weight_targets(model)
    count = nbytes = 0
    for piece in pieces:
        nbytes += copy_piece(targets, WeightPiece(*piece))
        count += 1
    return count, nbytes


# ---- the wire format ---------------------------------------------------------------------------------------
def encode_piece(piece: WeightPiece) -> tuple[bytes, memoryview]:
    """(length-prefixed header, payload view) of one frame; the payload is the tensor's own bytes (no copy when it
    is a contiguous CPU tensor)."""
    name, t, start = piece
    t = t.detach().contiguous().cpu()
    header = json.dumps({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "start": int(start)}).encode()  # fmt: skip
    payload = t.view(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
    return _LEN.pack(len(header)) + header, payload


class FrameReader:
    """Incremental parser of a streamed update: `feed(chunk)` yields the pieces whose last byte arrived.

    Holds at most one piece's bytes (plus the chunk being fed); `peak_bytes` is the largest amount it held, the
    receiver's extra memory for the update.
    """

    def __init__(self):
        self.buf = bytearray()
        self.need: tuple[dict, int] | None = None  # (header, payload bytes) of the frame being received
        self.peak_bytes = 0

    def feed(self, chunk: bytes) -> Iterator[WeightPiece]:
        self.buf += chunk
        self.peak_bytes = max(self.peak_bytes, len(self.buf))
        while True:
            if self.need is None:
                if len(self.buf) < _LEN.size:
                    return
                (n,) = _LEN.unpack_from(self.buf)
                if n > MAX_HEADER_BYTES:
                    raise InputError(f"weight update: frame header of {n} bytes (at most {MAX_HEADER_BYTES})")
                if len(self.buf) < _LEN.size + n:
                    return
                header = _parse_header(bytes(self.buf[_LEN.size : _LEN.size + n]))
                del self.buf[: _LEN.size + n]
                self.need = (header, math.prod(header["shape"]) * header["dtype"].itemsize)
            header, size = self.need
            if len(self.buf) < size:
                return
            # The payload leads the buffer: keep that bytearray as the piece's storage, the rest moves to a new one.
            data, self.buf = self.buf, self.buf[size:]
            del data[size:]
            self.need = None
            dtype = header["dtype"]
            t = torch.frombuffer(data, dtype=dtype) if size else torch.empty(0, dtype=dtype)
            yield WeightPiece(header["name"], t.view(header["shape"]), header["start"])

    def close(self) -> None:
        """Raise `InputError` if the body ended inside a frame."""
        if self.buf or self.need is not None:
            raise InputError("weight update: the body ended in the middle of a frame (truncated upload)")


def _parse_header(raw: bytes) -> dict:
    try:
        h = json.loads(raw)
        dtype = DTYPES[h["dtype"]]
        shape = [int(s) for s in h["shape"]]
        if not isinstance(h["name"], str) or any(s < 0 for s in shape):
            raise ValueError
        return {"name": h["name"], "dtype": dtype, "shape": shape, "start": int(h.get("start", 0))}
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"weight update: bad frame header {raw[:200]!r} ({type(e).__name__})") from None
