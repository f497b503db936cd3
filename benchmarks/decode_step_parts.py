"""Where a compiled decode step's time goes: the engine's host work, dynamo's guards, the graph's wrapper, kernels.

    python benchmarks/decode_step_parts.py [--batches 1 4 16] [--dtype float32] [--kernels 8] [--freeze-weights]

Model: `vs_llamacpp.py`'s variant of the 31M benchmark config (vocab 4096), random weights, the engine with its
decode graph compiled for each batch (inductor). Per batch, after warm-up, alternating 3 rounds of each:
- `step_ms`: `Engine.step` of decode-only steps (scheduler, the graph, sampling, bookkeeping), median of 64;
  `model_step_ms` its `ModelStep` call (the graph, the fused-weight check, the inputs), `host_ms` the difference
  (scheduling, sampling, bookkeeping);
- `graph_ms`: the compiled step alone through dynamo's entry (`DecodeGraph._compiled[N]`: frame evaluation,
  guards, the entry's attribute walk; every slot after 64 cached tokens, each with its own token: `fixed_inputs`),
  median of 64; `bound_ms` the same step
  as the engine calls it once bound (`DecodeGraph._bound[N]`: the graph function on its recorded tensors, no
  dynamo), alternating with it; `bound_ms / graph_ms` what binding saves;
- from one profiled run of the compiled step (torch profiler, self CPU time per step): `guards_ms` (dynamo's cache
  lookup: its guard evaluation), `wrapper_ms` (the compiled graph's wrapper: buffer allocation, kernel calls;
  without `--kernels` the generated kernels' time too), `kernels_ms` (the aten ops the graph calls, named
  `aoti_torch_cpu_*` under inductor's C++ wrapper: e.g. the GEMMs of products `fused.reduces` leaves; with `--kernels N`
  also inductor's generated kernels, compiled with `cpp.enable_kernel_profile` so each is a row, which slows every
  part by its hooks: take the times from a run without it), and the N heaviest kernels.
- `stream_ms`: streaming as many bytes as the weights the step reads whole (`stream_mib`: every parameter but
  the embedding tables), one buffer summed by ATen, median of 20: the memory floor of a step that touches every
  expert; `bound_ms` against it says how far the step is from memory-bound.
The load average is printed: parts timed at a load above the thread count are not results (every OpenMP barrier
of a generated kernel stretches then).

Output:
    batch=<B> dtype=<d> step_ms=<x> model_step_ms=<m> host_ms=<x - m> graph_ms=<y> bound_ms=<b> guards_ms=<g>
        wrapper_ms=<w> kernels_ms=<k> stream_ms=<f> stream_mib=<MiB> load=<l>
      <share>% <us> us/step <calls>/step <kernel name>      (the heaviest kernels, with --kernels N)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _vs_llamacpp():
    spec = importlib.util.spec_from_file_location("vs_llamacpp", HERE / "vs_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_for(batch: int, dtype: torch.dtype, seed: int, frozen: bool = False):
    from flashnext.build import build_model
    from flashnext.config import parse_config
    from flashnext.serve.engine import Engine

    model = build_model(parse_config(_vs_llamacpp().variant_config()), seed=seed, dtype=dtype)
    engine = Engine(model, max_slots=batch, max_model_len=32 + 64 + 1, decode_graph=True, decode_buckets=[batch],
                    freeze_weights=frozen)  # fmt: skip
    engine.decode_graph.warmup()
    return engine


def step_ms(engine, batch: int, gen: torch.Generator) -> tuple[float, float]:
    """Medians of `Engine.step` and of its `ModelStep` call (the decode graph with its input preparation) over the
    decode-only steps of `batch` greedy requests (32-token prompts, 64 tokens)."""
    from flashnext.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for p in torch.randint(0, engine.model.config.vocab_size, (batch, 32), generator=gen).tolist():
        engine.add_request(p, params)
    inner, model_times = engine.model_step, []

    def timed(plan):
        t0 = time.perf_counter()
        out = inner(plan)
        model_times.append(time.perf_counter() - t0)
        return out

    engine.model_step = timed
    times, model = [], []
    try:
        while engine.has_unfinished():
            prefill = bool(engine.waiting) or any(r.num_cached < len(r.prompt_ids) for r in engine.running)
            t0 = time.perf_counter()
            engine.step()
            if not prefill:
                times.append(time.perf_counter() - t0)
                model.append(model_times[-1])
    finally:
        engine.model_step = inner
    return statistics.median(times) * 1e3, statistics.median(model) * 1e3


def fixed_inputs(engine, batch: int) -> tuple[torch.Tensor, ...]:
    """The graph's inputs for `graph_ms` and `parts`: every slot decodes after 64 cached tokens, each its own
    token (spread over the vocabulary): one token in every row would route every row to the same experts, a
    quarter of those a real batch-16 step reads on this config (its step time 1.4 ms short, fp32 frozen)."""
    vocab = engine.model.config.vocab_size
    ids = [(1 + i * 7919) % vocab for i in range(batch)]
    return engine.decode_graph._inputs(ids, list(range(batch)), [64] * batch, batch)


def graph_ms(engine, batch: int, n: int = 64) -> tuple[float, float]:
    """Medians of the compiled step alone through dynamo's entry and bound (padding-free inputs: every slot decodes
    after 64 cached tokens, the middle of `step_ms`'s requests), alternating."""
    dg = engine.decode_graph
    inputs = fixed_inputs(engine, batch)
    calls = {"graph": dg._compiled[batch], "bound": dg._bound[batch]}
    times = {name: [] for name in calls}
    with torch.inference_mode():
        for _ in range(n):
            for name, call in calls.items():
                t0 = time.perf_counter()
                call(*inputs)
                times[name].append(time.perf_counter() - t0)
    return tuple(statistics.median(times[name]) * 1e3 for name in calls)


def stream_ms(model, n: int = 20) -> tuple[float, float]:
    """(median ms, MiB): streaming from memory as many bytes as the weights a decode step reads whole (every
    parameter but the embedding tables, token and n-gram, whose rows are looked up), as ATen's vectorised sum of
    one fp32 buffer that size: the memory floor of a step that touches every expert (batch 16 of this config; a
    size within a few times the L3 cache reads partly from it, e.g. bf16's 35 MiB at ~42 GB/s). One buffer, not
    the weights themselves: ~160 small sums would time their calls (~1.5 ms on this config), and a compiled sum
    reduces on one thread (~15 against ~25 GB/s on a 2-core EPYC)."""
    size = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)
    buffer = torch.ones(size // 4)
    times = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3, size / 2**20


def parts(engine, batch: int, steps: int = 30) -> tuple[dict[str, float], list[tuple[str, float, int]]]:
    """Self CPU ms per step of the guards, the wrapper and the kernels; the kernels as (name, ms, calls)."""
    from torch.profiler import ProfilerActivity, profile

    dg = engine.decode_graph
    inputs = fixed_inputs(engine, batch)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            dg._compiled[batch](*inputs)
    out = {"guards_ms": 0.0, "wrapper_ms": 0.0, "kernels_ms": 0.0}
    kernels = []
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / steps
        if e.key == "TorchDynamo Cache Lookup":
            out["guards_ms"] += ms
        elif e.key.startswith("## Call CompiledFxGraph"):
            out["wrapper_ms"] += ms
        elif e.key.startswith(("graph_", "aten::", "aoti_torch_cpu_")):  # the last: the C++ wrapper's aten calls
            out["kernels_ms"] += ms
            kernels.append((e.key, ms, e.count // steps))
    return out, sorted(kernels, key=lambda k: -k[1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kernels", type=int, default=0, help="list the N heaviest kernels of each batch")
    parser.add_argument("--freeze-weights", action="store_true", help="the graphs with the weights frozen in")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernels:  # a profiler row per generated kernel: a hook per kernel call, which slows every part
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    dtype = getattr(torch, args.dtype)
    for batch in args.batches:
        engine = engine_for(batch, dtype, args.seed, args.freeze_weights)
        gen = torch.Generator().manual_seed(args.seed)
        steps, models, graphs, bounds = [], [], [], []
        for _ in range(3):
            s, m = step_ms(engine, batch, gen)  # its first decode step binds the graph (bound afterwards)
            steps.append(s)
            models.append(m)
            g, b = graph_ms(engine, batch)
            graphs.append(g)
            bounds.append(b)
        step, model, graph, bound = (statistics.median(x) for x in (steps, models, graphs, bounds))
        split, kernels = parts(engine, batch)
        shown = " ".join(f"{k}={v:.2f}" for k, v in split.items())
        stream, mib = stream_ms(engine.model)
        print(f"batch={batch} dtype={args.dtype} step_ms={step:.2f} model_step_ms={model:.2f} "
              f"host_ms={step - model:.2f} graph_ms={graph:.2f} bound_ms={bound:.2f} {shown} "
              f"stream_ms={stream:.2f} stream_mib={mib:.1f} load={os.getloadavg()[0]:.1f}",
              flush=True)  # fmt: skip
        total = sum(ms for _, ms, _ in kernels) or 1.0
        for name, ms, calls in kernels[: args.kernels]:
            print(f"  {100 * ms / total:5.1f}% {ms * 1e3:7.1f} us/step {calls:3d}/step {name[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
