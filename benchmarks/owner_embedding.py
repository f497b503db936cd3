"""Owner-routed n-gram embedding vs all-gather/mask/reduce-scatter and DTensor rowwise, on gloo (CPU, fp32).

Setup (issue 4): a 65,536 x 160 fp32 table row-sharded over W ranks, 16,384 local tokens x 16 heads of ids per rank
(262,144 lookups), every rank running forward + backward of `(out * cotangent).sum()` on its own ids.
Ownership: `balanced` (ids uniform over the table) or `skewed` (every id on every rank owned by rank 0).

Methods (each gives every rank the vectors of its own ids and a gradient for the rows it holds):
  - `allgather`: all-gather every rank's ids, look up the locally owned ones in the local rows (others masked to 0),
    reduce-scatter the `[W * N, dim]` partial outputs back; backward all-gathers the output gradients.
  - `dtensor`: the table as `distribute_tensor(..., [Shard(0)])`, the all-gathered ids as a replicated DTensor,
    `F.embedding` (DTensor's rowwise strategy: masked lookup, Partial output), then `redistribute` to `Shard(0)`
    (a reduce-scatter) to keep this rank's part.
  - `ours` / `ours_nodedup`: `OwnerRoutedEmbedding` with dedup on / off.

Columns, per rank (the max over ranks is printed):
  - `grad_bytes`: bytes of the weight gradient the rank holds after backward (DTensor: its local tensor); the
    local rows are `local_rows * 160 * 4`; `exact` says whether grad_bytes equals that.
  - `peak_extra`: peak bytes of tensors allocated during one forward + backward, beyond what existed before
    (weights, ids, cotangent). Measured with an allocation hook: a `TorchDispatchMode` sees every op (re-entered
    inside DTensor ops so their local ops are seen too), counts the storage bytes of each output whose storage is
    new (not an input's, i.e. not a view or in-place result), and a `weakref.finalize` on each tensor object
    returns the bytes when the last tensor on that storage dies. The gradient itself counts (it is allocated in
    backward). Allocations inside gloo or inside a single kernel are not seen.
  - `ms`: forward + backward wall time, median of `--repeats` after `--warmup`, between barriers (so the slowest
    rank sets it).
The last line is `ws4_speedup_vs_allgather=<allgather ms / ours ms, balanced, W=4> grad_bytes_local_exact=<yes|no>`
(yes when every `ours` row of every world size holds exactly its local rows).

    python benchmarks/owner_embedding.py --world-sizes 2 4                 # full size (minutes on 2 cores)
    python benchmarks/owner_embedding.py --world-sizes 2 4 --scale 0.125   # quick

Each rank uses one thread; on a machine with fewer cores than ranks the timings include time-slicing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from flashnext.memory import PeakBytes  # noqa: E402
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding, row_ranges  # noqa: E402

ROWS, DIM, TOKENS, HEADS = 65_536, 160, 16_384, 16
METHODS = ("allgather", "dtensor", "ours", "ours_nodedup")
OWNERSHIP = ("balanced", "skewed")


class _ReduceScatter(torch.autograd.Function):
    """Sum-reduce-scatter along dim 0 (equal chunks); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        w = dist.get_world_size()
        out = x.new_empty((x.shape[0] // w, *x.shape[1:]))
        dist.reduce_scatter_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        out = grad.new_empty((grad.shape[0] * dist.get_world_size(), *grad.shape[1:]))
        dist.all_gather_single(out, grad.contiguous())
        return out


def _all_ids(ids: torch.Tensor) -> torch.Tensor:
    out = ids.new_empty((ids.numel() * dist.get_world_size(),))
    dist.all_gather_single(out, ids.reshape(-1).contiguous())
    return out


def _make(method: str, full: torch.Tensor, start: int, end: int):
    """(parameter, forward(ids) -> [N, dim] local output, local gradient getter)."""
    if method == "allgather":
        weight = torch.nn.Parameter(full[start:end].clone())

        def fwd(ids):
            every = _all_ids(ids)
            mine = (every >= start) & (every < end)
            part = F.embedding((every - start).clamp(0, max(end - start - 1, 0)), weight) * mine[:, None]
            return _ReduceScatter.apply(part)

        return weight, fwd, lambda: weight.grad
    if method == "dtensor":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None))

        def fwd(ids):
            every = DTensor.from_local(_all_ids(ids), mesh, [Replicate()])
            return F.embedding(every, weight).redistribute(mesh, [Shard(0)]).to_local()

        return weight, fwd, lambda: weight.grad.to_local()
    emb = OwnerRoutedEmbedding(full.shape[0], full.shape[1], dedup=method == "ours")
    with torch.no_grad():
        emb.weight.copy_(full[start:end])
    return emb.weight, lambda ids: emb(ids.reshape(-1)), lambda: emb.weight.grad


def _ids(rank: int, world: int, rows: int, tokens: int, ownership: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1 + rank)
    hi = rows if ownership == "balanced" else row_ranges(rows, world)[0][1]
    return torch.randint(0, hi, (tokens, HEADS), generator=g)


def _measure(method, ownership, rank, world, rows, tokens, warmup, repeats) -> dict:
    full = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(0))
    start, end = row_ranges(rows, world)[rank]
    weight, fwd, grad_of = _make(method, full, start, end)
    del full
    ids = _ids(rank, world, rows, tokens, ownership)
    cot = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(2 + rank))
    times, peak = [], 0
    for i in range(warmup + repeats):
        weight.grad = None
        tracker = PeakBytes() if i == warmup else None  # one measured run; tracking slows the op calls
        dist.barrier()
        t0 = time.perf_counter()
        if tracker is not None:
            with tracker:
                (fwd(ids) * cot).sum().backward()
            peak = tracker.peak
        else:
            (fwd(ids) * cot).sum().backward()
        dist.barrier()
        if i >= warmup and tracker is None:
            times.append(time.perf_counter() - t0)
    grad = grad_of()
    return {
        "grad_bytes": grad.numel() * grad.element_size(),
        "local_bytes": (end - start) * DIM * 4,
        "peak_extra": peak,
        "ms": 1000 * statistics.median(times),
    }


def _rank_main(rank: int, world: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    rows, tokens = max(world, int(ROWS * args.scale)), max(1, int(TOKENS * args.scale))
    try:
        for ownership in OWNERSHIP:
            for method in METHODS:
                res = _measure(method, ownership, rank, world, rows, tokens, args.warmup, args.repeats + 1)
                queue.put((world, ownership, method, rank, res))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _next(queue, procs):
    """The next result; raises (after killing the ranks) as soon as one rank has died."""
    while True:
        try:
            return queue.get(timeout=5)
        except Exception:  # queue.Empty
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--scale", type=float, default=1.0, help="shrink rows and tokens (1.0 = the issue's sizes)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (one more run measures memory)")
    args = ap.parse_args()
    rows, tokens = int(ROWS * args.scale), int(TOKENS * args.scale)
    print(f"# table {rows} x {DIM} fp32, {tokens} tokens x {HEADS} heads per rank, gloo, 1 thread per rank, "
          f"{os.cpu_count()} cpus")  # fmt: skip
    print(f"{'ws':>3} {'ownership':>9} {'method':>13} {'grad_bytes':>11} {'exact':>5} {'peak_extra_MiB':>14} "
          f"{'ms':>9}")  # fmt: skip
    ctx = mp.get_context("spawn")
    table = {}
    for world in args.world_sizes:
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows_by_key: dict = {}
        for _ in range(world * len(OWNERSHIP) * len(METHODS)):
            w, own, method, rank, res = _next(queue, procs)
            rows_by_key.setdefault((own, method), {})[rank] = res
            if len(rows_by_key[(own, method)]) == world:
                per = rows_by_key[(own, method)].values()
                row = {
                    "grad_bytes": max(r["grad_bytes"] for r in per),
                    "exact": all(r["grad_bytes"] == r["local_bytes"] for r in per),
                    "peak_extra": max(r["peak_extra"] for r in per),
                    "ms": max(r["ms"] for r in per),
                }
                table[(w, own, method)] = row
                print(f"{w:>3} {own:>9} {method:>13} {row['grad_bytes']:>11} {'yes' if row['exact'] else 'no':>5} "
                      f"{row['peak_extra'] / 2**20:>14.1f} {row['ms']:>9.1f}", flush=True)  # fmt: skip
        for p in procs:
            p.join()
    exact = all(v["exact"] for (w, o, m), v in table.items() if m.startswith("ours"))
    ws4 = (4, "balanced")
    speedup = (
        table[(*ws4, "allgather")]["ms"] / table[(*ws4, "ours")]["ms"] if (*ws4, "ours") in table else float("nan")
    )
    print(f"ws4_speedup_vs_allgather={speedup:.2f} grad_bytes_local_exact={'yes' if exact else 'no'}")


if __name__ == "__main__":
    main()
