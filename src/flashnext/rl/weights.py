"""Weight sync from the trainer to the inference engine, one tensor (or row piece) at a time.

In one process (`sync_local`): each trainer tensor is copied into the engine's tensor of the same name with
`copy_` (`Engine.load_weights`): no copy of the model is ever made, the engine's weights equal the trainer's bitwise
afterwards, and the engine's fused serving weights rebuild on their next use.

Across processes (`HTTPWeightSync`, a trainer under torchrun and a separate `flashnext serve --admin-key KEY`):
1. rank 0 `begin`s an update: the server stops admitting requests, lets the running ones finish on the old weights
   and parks its engine (queued requests wait; none is lost);
2. rank 0 streams every non-table tensor in one chunked HTTP body (`serve.weight_update` frames), gathering each
   FSDP2 parameter with `full_tensor()` as it goes (every rank takes part in each gather, in the same order), so
   it holds one tensor at a time; tensors larger than `chunk_bytes` go as row pieces;
3. every rank streams the rows of each trainable n-gram table it owns (`OwnerRoutedEmbedding`), in pieces of at
   most `chunk_bytes`, in its own HTTP body: a table is never gathered on any rank;
4. rank 0 `end`s the update once every rank is done (a barrier): the server's weight version becomes the
   trainer's step and it resumes.
Only trainable tensors travel after the first sync (frozen ones, e.g. a frozen vision tower or frozen n-gram
tables, cannot have changed); `full=True` sends every parameter and buffer.

An update is all or nothing on the server: every piece is checked (name, rows, dtype) when it arrives and held until
`end`, which applies them all; a refused piece aborts the update and the server keeps serving its old weights. The
server refuses a piece of another dtype than its tensor, so the sender converts each piece to the dtype the server's
`begin` reply lists for it (fp32 master weights to a bf16 server, say). A failed upload on any rank makes every rank
raise, after rank 0 has ended (aborted) the update so the server resumes at once.

Each sync returns `SyncStats`: seconds, tensors, bytes and the peak extra bytes it allocated (local: measured by an
allocation hook; HTTP: the largest gathered tensor plus its converted frame on the sender, and on the server every
byte of the update, held until it is applied).
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from flashnext.errors import FlashNextError
from flashnext.memory import PeakBytes
from flashnext.rl.inference import post_json
from flashnext.serve.weight_update import DTYPES, WeightPiece, encode_piece

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass
class SyncStats:
    """What one weight sync did: wall seconds, pieces and bytes sent, peak extra bytes (sender; receiver)."""

    seconds: float = 0.0
    tensors: int = 0
    bytes: int = 0
    peak_extra_bytes: int = 0
    server_peak_extra_bytes: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "sync/seconds": self.seconds, "sync/bytes": self.bytes, "sync/tensors": self.tensors,
            "sync/peak_extra_bytes": self.peak_extra_bytes,
            "sync/server_peak_extra_bytes": self.server_peak_extra_bytes,
        }  # fmt: skip


def _wanted(t: torch.Tensor, full: bool) -> bool:
    return full or (isinstance(t, nn.Parameter) and t.requires_grad)


def local_pieces(model: nn.Module, full: bool = False) -> Iterator[WeightPiece]:
    """(name, tensor) of every trainable parameter of a single-process model (`full`: every parameter and buffer)."""
    for name, p in model.named_parameters():
        if _wanted(p, full):
            yield WeightPiece(name, p.detach())
    if full:
        for name, b in model.named_buffers():
            yield WeightPiece(name, b.detach())


def sync_local(model: nn.Module, engine, full: bool = False, version: int | None = None) -> SyncStats:
    """Copy the trainer model's weights into `engine` in place (call it while nothing steps the engine).

    Args:
        model: the trainer's single-process model (names as the engine model's).
        engine: the `Engine` whose weights are replaced.
        full: every parameter and buffer (the first sync), else the trainable parameters.
        version: the engine's new `weight_version` (the trainer step), if given.
    """
    t0 = time.perf_counter()
    with torch.no_grad(), PeakBytes() as mem:
        count, nbytes = engine.load_weights(local_pieces(model, full))
    if version is not None:
        engine.weight_version = version
    return SyncStats(time.perf_counter() - t0, count, nbytes, mem.peak)


# ---- across processes ----------------------------------------------------------------------------------------
def _rows_per_piece(t: torch.Tensor, chunk_bytes: int) -> int:
    row = t[0].numel() * t.element_size() if t.dim() else t.element_size()
    return max(1, chunk_bytes // max(row, 1))


def _split_rows(name: str, t: torch.Tensor, start: int, chunk_bytes: int) -> Iterator[WeightPiece]:
    if t.dim() == 0 or t.numel() * t.element_size() <= chunk_bytes:
        yield WeightPiece(name, t, start)
        return
    n = _rows_per_piece(t, chunk_bytes)
    for a in range(0, t.shape[0], n):
        yield WeightPiece(name, t[a : a + n], start + a)


class HTTPWeightSync:
    """Streams a (possibly FSDP2-sharded) trainer model's weights to a `flashnext serve --admin-key KEY`.

    Args:
        url: the server's base URL.
        admin_key: its admin key (default: the `FLASHNEXT_ADMIN_KEY` environment variable).
        chunk_bytes: the largest piece sent (bigger tensors, and table shards, go as row pieces).
        timeout: seconds for one HTTP call (`begin` waits for in-flight requests to finish).
    """

    def __init__(self, url: str, admin_key: str | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout: float = 600.0):  # fmt: skip
        self.url = url.rstrip("/")
        self.key = admin_key if admin_key is not None else os.environ.get("FLASHNEXT_ADMIN_KEY")
        if not self.key:
            raise FlashNextError("weight sync to a server needs its admin key: set FLASHNEXT_ADMIN_KEY")
        self.chunk_bytes, self.timeout = chunk_bytes, timeout
        self.dtypes: dict[str, torch.dtype] = {}  # the server's dtype of each tensor, from `begin`

    def begin(self) -> str:
        reply = post_json(f"{self.url}/admin/weights/begin", None, self.key, self.timeout)
        self.dtypes = {n: DTYPES[t["dtype"]] for n, t in reply.get("tensors", {}).items() if t["dtype"] in DTYPES}
        return reply["update_id"]

    def end(self, update_id: str, version: int) -> dict:
        body = {"update_id": update_id, "weight_version": version}
        return post_json(f"{self.url}/admin/weights/end", body, self.key, self.timeout)

    def push(self, update_id: str, pieces: Iterator[WeightPiece]) -> tuple[dict, int]:
        """Stream `pieces` in one chunked POST; returns (the server's reply, this sender's peak extra bytes)."""
        u = urllib.parse.urlsplit(self.url)
        connection = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = connection(u.hostname, u.port, timeout=self.timeout)
        peak = [0]

        def body():
            for piece in pieces:
                t, want = piece.tensor, self.dtypes.get(piece.name)
                wire = piece._replace(tensor=t.to(want)) if want is not None and t.dtype != want else piece
                header, payload = encode_piece(wire)
                nbytes = t.numel() * t.element_size()
                peak[0] = max(peak[0], nbytes + wire.tensor.numel() * wire.tensor.element_size())  # + its frame
                yield header
                if len(payload):
                    yield payload

        try:
            conn.request(
                "POST", f"{u.path.rstrip('/')}/admin/weights/update?update_id={update_id}", body=body(),
                encode_chunked=True,
                headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/octet-stream",
                         "Transfer-Encoding": "chunked"},
            )  # fmt: skip
            resp = conn.getresponse()
            data = resp.read()
        except OSError as e:
            raise FlashNextError(f"weight sync to {self.url}: {e}") from None
        finally:
            conn.close()
        if resp.status != 200:
            detail = data[:500].decode(errors="replace")
            raise FlashNextError(f"weight sync to {self.url}: HTTP {resp.status}: {detail}")
        return json.loads(data), peak[0]


def distributed_pieces(model: nn.Module, rank: int, full: bool, chunk_bytes: int) -> tuple[Iterator, Iterator]:
    """(rank 0's pieces: every non-table tensor, gathered one at a time; this rank's table-row pieces).

    Iterate the first on every rank (the FSDP2 gathers are collectives); only rank 0 gets pieces from it.
    """
    from torch.distributed.tensor import DTensor

    from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding

    tables = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, OwnerRoutedEmbedding)}

    def dense() -> Iterator[WeightPiece]:
        for name, p in model.named_parameters():
            if name in tables or not _wanted(p, full):
                continue
            t = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if rank == 0:
                yield from _split_rows(name, t.detach(), 0, chunk_bytes)
            del t
        if full and rank == 0:
            for name, b in model.named_buffers():
                if name not in tables and not name.endswith("ngram_embedding.weight_scale"):
                    yield from _split_rows(name, b.detach(), 0, chunk_bytes)

    def rows() -> Iterator[WeightPiece]:
        for name, table in tables.items():
            w = table.weight
            if not _wanted(w, full) or w.shape[0] == 0:
                continue
            yield from _split_rows(name, w.detach(), table.row_start, chunk_bytes)

    return dense(), rows()


def sync_distributed(model: nn.Module, client: HTTPWeightSync, version: int, full: bool = False) -> SyncStats:
    """Every rank: push this model's weights to the server (see the module doc); collective."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    t0 = time.perf_counter()
    ids = [client.begin() if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(ids, src=0)
    dense, rows = distributed_pieces(model, rank, full, client.chunk_bytes)
    replies, peak, errors = [], 0, []

    def push(pieces) -> None:
        nonlocal peak
        try:
            reply, p = client.push(ids[0], pieces)
            replies.append(reply)
            peak = max(peak, p)
        except FlashNextError as e:
            errors.append(str(e))
            for _ in pieces:  # the rest of the gathers, in step with the other ranks
                pass

    with torch.no_grad():
        if rank == 0:
            push(dense)
        else:
            for _ in dense:  # the gathers, in step with rank 0
                pass
        push(rows)
    local = [sum(r["tensors"] for r in replies), sum(r["bytes"] for r in replies), peak,
             max((r["peak_extra_bytes"] for r in replies), default=0), float(bool(errors))]  # fmt: skip
    totals = torch.tensor(local, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(totals[:2])
        peaks = totals[2:].clone()
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        totals[2:] = peaks
        dist.barrier()  # every rank's rows are in before the update ends
    if rank == 0:
        try:
            done = client.end(ids[0], version)  # after a failed upload: the server aborts and keeps its weights
            totals[3] = max(totals[3].item(), done.get("peak_extra_bytes", 0))
        except FlashNextError as e:
            errors.append(str(e))
    if errors or totals[4].item():
        raise FlashNextError("weight sync failed, the server keeps its previous weights: " +
                             ("; ".join(errors) if errors else "an upload failed on another rank"))
    totals = totals[:4]
    tensors, nbytes, peak, server_peak = (int(x) for x in totals.tolist())
    return SyncStats(time.perf_counter() - t0, tensors, nbytes, peak, server_peak)
