"""Weight updates of a serving model from a trainer: all or nothing, tensors copied in place by name.

A piece is a tensor, or rows `[start, start + n)` of one along dim 0 (how an n-gram table travels: by row shard,
each trainer rank sending the rows it owns, never the whole table; large tensors are cut the same way). Every piece
is checked against the model (`check_piece`: its name, its rows and shape, its dtype, which must be the model
tensor's own: a payload of another dtype is refused, never cast, except a float piece for a tensor held quantised,
which is requantised on arrival: `Targets.requantize`) before any piece is copied, so a bad piece leaves the
model untouched. Copies are `copy_` into the model's parameters and buffers (no model-sized copy on the device); the
fused serving weights (`model/fused.py`) notice the in-place change (version counter) and rebuild on their next use.

- In one process (`copy_pieces`) the pieces are the trainer's own tensors: all are checked, then all copied.
- Over HTTP (`StagedUpdate`, the admin routes of `flashnext serve`) an update is one or more streamed uploads (one
  per trainer rank, possibly at once). Each piece is checked from its frame header, before its payload is read, and
  its payload lands in a host-memory tensor held until the update ends; only then is everything copied into the
  model. A bad piece, a truncated body or a dropped connection aborts the whole update (what was held is freed) and
  the served model stays as it was. The price is host memory: the receiver holds every byte of an update at once
  (the trainable tensors, or the whole model on a full sync) until `apply`, reported as `peak_extra_bytes`.

The wire format of an upload, one frame per piece, back to back in one HTTP body:
    uint32 little-endian header length | header (UTF-8 JSON) | payload
with the header `{"name": str, "dtype": str, "shape": [int, ...], "start": int}` (dtype a torch dtype name such as
`float32`, `bfloat16`, `float8_e4m3fn`; `start` the first row along dim 0) and the payload the piece's bytes,
C-contiguous, `prod(shape) * itemsize` of them. `FrameReader` parses a body fed in arbitrary chunks, checks each
header as it completes and writes the payload straight into the piece's tensor.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import numpy as np
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


class Targets(dict):
    """{state-dict name: tensor}, and `requantize`: {name: fn(start, rows)} for tensors a module holds quantised
    (`requantized` names and a `requantize_(name, start, rows)` method, e.g. `Fp8Experts`): those take pieces in any
    float dtype and quantise them on arrival, in the same all-or-nothing update. A model quantized in memory
    (`flashnext.quant`) also lists the float names of its quantized weights (`quant.apply.RequantTarget`s, which
    requantize the rows they are given)."""

    def __init__(self, model: nn.Module):
        from flashnext.quant.apply import requant_targets

        super().__init__({**dict(model.named_buffers()), **dict(model.named_parameters()), **requant_targets(model)})
        self.requantize = {
            f"{prefix}.{name}" if prefix else name: functools.partial(module.requantize_, name)
            for prefix, module in model.named_modules()
            for name in getattr(module, "requantized", ())
        }


def weight_targets(model: nn.Module) -> Targets:
    """Every parameter and buffer of `model` by its state-dict name (what a piece's `name` refers to)."""
    return Targets(model)


def check_piece(targets: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape, start: int = 0) -> int:
    """Check that rows `[start, start + shape[0])` of `dtype` fit the model tensor `name`; returns their bytes.

    Raises:
        InputError: naming the tensor, what the model holds and what the piece is, when the name is unknown, the
            dtype differs (never cast: the sender converts) or the rows or shape do not fit.
    """
    dst, shape = targets.get(name), tuple(shape)
    if dst is None:
        raise InputError(f"weight update: the model has no tensor {name!r}")
    if dtype != dst.dtype and not (dtype.is_floating_point and name in getattr(targets, "requantize", {})):
        raise InputError(f"weight update: {name} is {str(dst.dtype).removeprefix('torch.')} in the model, got a "
                         f"{str(dtype).removeprefix('torch.')} piece (send it in the model's dtype)")  # fmt: skip
    if dst.dim() == 0 or len(shape) == 0:
        if start or shape != tuple(dst.shape):
            raise InputError(f"weight update: {name} is a scalar; got shape {shape} at row {start}")
    else:
        stop = start + shape[0]
        if start < 0 or stop > dst.shape[0] or shape[1:] != tuple(dst.shape[1:]):
            raise InputError(
                f"weight update: {name} has shape {tuple(dst.shape)}; rows [{start}, {stop}) of shape {shape} do "
                "not fit it"
            )
    return math.prod(shape) * dtype.itemsize


@torch.no_grad()
def _copy(targets: dict[str, torch.Tensor], piece: WeightPiece) -> int:
    """Copy one checked piece into its target in place; returns the bytes written."""
    name, src, start = piece
    dst = targets[name]
    if hasattr(dst, "write_rows"):  # a quantized weight (`quant.apply.RequantTarget`): requantized from the rows
        return dst.write_rows(start, src)
    if src.dtype != dst.dtype:  # a quantised tensor (check_piece allowed it): requantised from the float rows
        targets.requantize[name](start, src)
        return src.numel() * dst.element_size()
    rows = dst if dst.dim() == 0 else dst[start : start + src.shape[0]]
    rows.copy_(src)
    return rows.numel() * rows.element_size()


def copy_piece(targets: dict[str, torch.Tensor], piece: WeightPiece) -> int:
    """Check one piece (`check_piece`) and copy it into its target in place; returns the bytes written."""
    name, src, start = piece
    check_piece(targets, name, src.dtype, src.shape, start)
    return _copy(targets, piece)


def copy_pieces(model: nn.Module, pieces: Iterable[WeightPiece | tuple]) -> tuple[int, int]:
    """Check every piece, then copy them all into `model` in order; returns (pieces, bytes). A bad piece raises
    (`check_piece`) before anything is copied. The pieces are held by reference only (no copy)."""
    targets = weight_targets(model)
    pieces = [WeightPiece(*p) for p in pieces]
    for name, src, start in pieces:
        check_piece(targets, name, src.dtype, src.shape, start)
    return len(pieces), sum(_copy(targets, p) for p in pieces)


class StagedUpdate:
    """One update received over HTTP: pieces checked on arrival, held in host memory, applied at once by `apply`.

    Several uploads (`FrameReader`s) may feed it at once. `error` is set, and everything held is freed, by the first
    `fail`; a failed update applies nothing. `peak_bytes` is the most it held at once (the pieces kept plus the
    pieces being received), the receiver's extra memory for the update.
    """

    def __init__(self, model: nn.Module):
        self.targets = weight_targets(model)
        self.pieces: list[WeightPiece] = []
        self.bytes = self.peak_bytes = 0
        self.readers: set[FrameReader] = set()
        self.error: str | None = None

    def check(self, header: dict) -> None:
        if self.error is not None:
            raise InputError(f"weight update aborted ({self.error})")
        check_piece(self.targets, header["name"], header["dtype"], header["shape"], header["start"])

    def reader(self) -> FrameReader:
        """A reader for one upload, whose pieces are checked against the model and whose memory is counted here."""
        r = FrameReader(self.check)
        self.readers.add(r)
        return r

    def keep(self, piece: WeightPiece) -> None:
        if self.error is not None:
            return  # another upload aborted the update while this piece arrived
        self.pieces.append(piece)
        self.bytes += piece.tensor.numel() * piece.tensor.element_size()
        self.note()

    def note(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.bytes + sum(r.held for r in self.readers))

    def fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self.pieces.clear()
        self.bytes = 0

    def apply(self) -> tuple[int, int]:
        """Copy every held piece into the model (all were checked on arrival); returns (pieces, bytes)."""
        if self.error is not None:
            raise InputError(f"weight update aborted ({self.error}): nothing to apply")
        done = len(self.pieces), sum(_copy(self.targets, p) for p in self.pieces)
        self.pieces.clear()
        return done


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
    """Incremental parser of one upload: `feed(chunk)` yields the pieces whose last byte arrived.

    Each header is passed to `check` (which raises to refuse the piece) before any of its payload is read; the
    payload is written straight into a new tensor of the piece's shape and dtype (on the CPU). `held` is the bytes
    this reader holds now (the piece being received and a partial header), `peak_bytes` the most it held.
    """

    def __init__(self, check: Callable[[dict], None] | None = None):
        self.check = check
        self.buf = bytearray()  # a partial frame header
        self.header: dict | None = None  # the frame being received: its header, tensor, bytes view, bytes filled
        self.tensor: torch.Tensor | None = None
        self.raw = None
        self.filled = 0
        self.held = self.peak_bytes = 0

    def _take(self, view: memoryview, i: int, upto: int) -> int:
        """Append bytes of `view` from `i` to the header buffer until it holds `upto`; returns the new `i`."""
        n = min(upto - len(self.buf), len(view) - i)
        if n > 0:
            self.buf += view[i : i + n]
        return i + max(n, 0)

    def _start(self, header: dict) -> None:
        if self.check is not None:
            self.check(header)
        self.header, self.filled = header, 0
        self.tensor = torch.empty(header["shape"], dtype=header["dtype"])
        self.raw = self.tensor.view(-1).view(torch.uint8).numpy() if self.tensor.numel() else None
        self.held = self.tensor.numel() * self.tensor.element_size()
        self.peak_bytes = max(self.peak_bytes, self.held + len(self.buf))

    def feed(self, chunk: bytes) -> Iterator[WeightPiece]:
        view, i = memoryview(chunk).cast("B"), 0
        while True:
            if self.header is None:
                i = self._take(view, i, _LEN.size)
                if len(self.buf) < _LEN.size:
                    return
                (n,) = _LEN.unpack_from(self.buf)
                if n > MAX_HEADER_BYTES:
                    raise InputError(f"weight update: frame header of {n} bytes (at most {MAX_HEADER_BYTES})")
                i = self._take(view, i, _LEN.size + n)
                if len(self.buf) < _LEN.size + n:
                    return
                header = _parse_header(bytes(self.buf[_LEN.size :]))
                self.buf.clear()
                self._start(header)
            size = self.held
            n = min(size - self.filled, len(view) - i)
            if n > 0:
                self.raw[self.filled : self.filled + n] = np.frombuffer(view[i : i + n], dtype=np.uint8)
                self.filled, i = self.filled + n, i + n
            if self.filled < size:
                return
            piece = WeightPiece(self.header["name"], self.tensor, self.header["start"])
            self.header = self.tensor = self.raw = None
            self.held = 0
            yield piece

    def close(self) -> None:
        """Raise `InputError` if the body ended inside a frame."""
        if self.buf or self.header is not None:
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
