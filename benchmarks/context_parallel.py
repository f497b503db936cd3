"""Context parallelism on gloo: forward+backward of one long sequence split across CP 1, 2, 4 ranks.

Setup: the 31M config of `benchmarks/model_vs_reference.py` (hidden 256, 8 layers: 6 GDN + 2 QSA with budget 128 /
compress 4, PLE on 2 layers, 16 experts top-4, vocab 16384), fp32, randomly initialised with the same seed on every
rank; one sequence of `--tokens` tokens (default 16,384) is laid out by `parallel.context.plan_layout` and each rank
runs forward + backward (next-token CE formed on the whole stream) of its slice with the model's `cp` argument
(GDN affine pairs, PLE/conv halos, QSA key/value and block-key all-gathers), with activation checkpointing per
decoder layer (`--no-ac` keeps every activation: one process then adds ~2.8 GiB at 2,048 tokens, linearly more at
16k). CP 1 is the plain single-process forward (no process group). Each CP size runs in
fresh spawned processes on 127.0.0.1 with `max(1, --threads // cp)` threads per rank.

Columns, per CP size:
  - `tok_s`: tokens / the step's wall time (median of `--repeats` after `--warmup`; ranks start together after a
    barrier and the step ends when the slowest rank is done);
  - `peak_rss_mib`: each rank's resident-set high-water mark (the process's `ru_maxrss`: imports, model, its
    gradients and the step's activations), then `step_mib`, that peak minus the rank's RSS before its first step
    (what the step itself adds: activations, gradients, exchanged tensors).
The last line: `cp<n>_speedup=<tok_s cp n / cp 1>` for each CP size, then `cp<n>_step_mem_ratio=<largest step_mib of
a CP n rank / CP 1's>`.

On a box with fewer cores than ranks the ranks time-slice (CP 4 on 2 cores runs 4 one-thread ranks on 2 cores), so
the speedups there measure overhead, not scaling; the memory columns are what CP is for.

    python benchmarks/context_parallel.py                           # 16,384 tokens at CP 1, 2, 4
    python benchmarks/context_parallel.py --tokens 4096 --cps 1 2   # quick
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from flashnext.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from flashnext.batch import PackedBatch  # noqa: E402
from flashnext.build import build_model  # noqa: E402
from flashnext.config import parse_config  # noqa: E402
from flashnext.parallel.context import DistributedShard, plan_layout  # noqa: E402
from flashnext.train.loss import shifted_sft_loss  # noqa: E402


def benchmark_config():
    """The 31M config of `benchmarks/model_vs_reference.py`."""
    spec = importlib.util.spec_from_file_location("model_vs_reference", ROOT / "benchmarks" / "model_vs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return parse_config(dict(module.CONFIG)).text


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(rank: int, cp: int, args) -> dict:
    """One rank: build the model, time `warmup + repeats` forward+backward steps of its slice."""
    torch.set_num_threads(max(1, args.threads // cp))
    cfg = benchmark_config()
    model = build_model(cfg, seed=0, dtype=torch.float32, device="cpu").train()
    if args.ac:
        apply_activation_checkpointing(model)
    ids = torch.randint(3, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    batch = PackedBatch.from_sequences([ids.tolist()], [ids.tolist()])
    layout = plan_layout(batch.lengths, cp, cfg.indexer_compress_ratio)
    lo, hi = layout.rows(rank)
    local_ids, local_pos = layout.pad(batch.input_ids)[lo:hi], layout.pad(batch.position_ids)[lo:hi]
    cu = torch.tensor(layout.local_cu(rank), dtype=torch.int32)
    targets = layout.targets(batch.labels, batch.cu_seqlens)[lo:hi]
    shard = DistributedShard(layout, rank) if cp > 1 else None
    before = current_rss_mib()
    times = []
    for _ in range(args.warmup + args.repeats):
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        logits = model(local_ids, cu_seqlens=cu, position_ids=local_pos, cp=shard).logits
        shifted_sft_loss(logits, targets, args.tokens).backward()
        del logits
        if cp > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"seconds": statistics.median(times[args.warmup :]), "peak": rss_mib(), "before": before}


def _child(rank: int, cp: int, port: int, args, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp, timeout=datetime.timedelta(hours=1)
    )
    try:
        results.put((rank, run(rank, cp, args)))
    finally:
        dist.destroy_process_group()


def spawn(cp: int, args) -> list[dict]:
    """`run` on every rank of a fresh gloo group of `cp` processes (CP 1: one process, no group)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if cp == 1:
        procs = [ctx.Process(target=_single, args=(args, results))]
    else:
        procs = [ctx.Process(target=_child, args=(r, cp, port, args, results)) for r in range(cp)]
    for p in procs:
        p.start()
    out = dict(results.get() for _ in procs)
    for p in procs:
        p.join()
    return [out[r] for r in range(cp)]


def _single(args, results) -> None:
    results.put((0, run(0, 1, args)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--threads", type=int, default=2, help="threads shared by the ranks of one CP size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-ac", dest="ac", action="store_false", help="no activation checkpointing")
    args = parser.parse_args()
    print(f"# tokens={args.tokens} threads={args.threads} warmup={args.warmup} repeats={args.repeats} ac={args.ac}")
    rows = {}
    for cp in args.cps:
        res = spawn(cp, args)
        seconds = max(r["seconds"] for r in res)
        rows[cp] = (args.tokens / seconds, [r["peak"] for r in res], [r["peak"] - r["before"] for r in res])
        tok_s, peaks, steps = rows[cp]
        print(f"cp={cp} tok_s={tok_s:.0f} peak_rss_mib={','.join(f'{p:.0f}' for p in peaks)} "
              f"step_mib={','.join(f'{s:.0f}' for s in steps)}", flush=True)  # fmt: skip
    base = rows.get(1)
    if base:
        speed = " ".join(f"cp{cp}_speedup={rows[cp][0] / base[0]:.2f}" for cp in args.cps if cp != 1)
        mem = " ".join(f"cp{cp}_step_mem_ratio={max(rows[cp][2]) / max(base[2]):.2f}" for cp in args.cps if cp != 1)
        print(f"{speed} {mem}")


if __name__ == "__main__":
    main()
