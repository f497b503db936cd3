"""The int8 trunk's products in the compiled decode step: the packed kernel against the fused reduction, per step.

    python benchmarks/int8_reduced.py [--batches 1 4 8 16] [--rounds 5] [--steps 32] [--threads 2]

Model: `vs_llamacpp.py`'s variant of the benchmark config (hidden 256, 8 layers, 16 experts top-4, vocab 4096),
random weights (`build_model`, seed 0), fp32, quantized to weight-only int8 (`quantize_model`, trunk and experts:
what `vs_llamacpp.py --quant q8_0` serves). Per batch size two engines with the compiled decode step (inductor,
one bucket), differing only in the bound on rows under which `int8_linear` runs as a reduction inside the graph
(`fused.reduced_linear`; `quant.int_linear.REDUCED_ROWS`, set while each one compiles and runs):
- kernel: bound 0, every int8 product through `_weight_int8pack_mm` (bf16 activations, cast in and out);
- reduced: bound 64, every int8 product of the step as the fused fp32 reduction over the int8 codes.
The experts run `QuantExperts._reduced` in both. Each round times `--steps` decode steps (`DecodeGraph.run`, the
graph alone: no scheduler, no sampler) of one engine, then of the other; a variant's figure is the median over its
rounds of the median step. The box is shared: the 1-min load is printed beside each line.

Output, per batch:
    batch=<b> kernel_ms=<ms> reduced_ms=<ms> speedup=<kernel / reduced> load=<1-min load, max over the rounds>
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
BOUNDS = {"kernel": 0, "reduced": 64}


def variant_config() -> dict:
    spec = importlib.util.spec_from_file_location("vs_llamacpp", HERE / "vs_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.variant_config()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from flashnext.build import build_model
    from flashnext.config import parse_config
    from flashnext.quant import int_linear
    from flashnext.quant.apply import QuantScheme, quantize_model
    from flashnext.serve.engine import Engine

    torch.set_num_threads(args.threads)
    cfg = parse_config(variant_config()).text
    model = build_model(cfg, seed=0, dtype=torch.float32)
    quantize_model(model, QuantScheme.from_flags("int8"))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    for b in args.batches:
        graphs = {}
        for name, bound in BOUNDS.items():
            int_linear.REDUCED_ROWS = bound
            engine = Engine(model, max_slots=b, max_model_len=128, decode_graph=True, decode_buckets=[b])
            took = engine.decode_graph.warmup()[b]
            graphs[name] = engine.decode_graph
            print(f"# batch={b} {name}: compiled in {took:.1f} s", flush=True)
        ids = torch.randint(0, cfg.vocab_size, (b,), generator=gen).tolist()
        slots, cached = list(range(b)), [40] * b
        medians: dict[str, list[float]] = {name: [] for name in BOUNDS}
        loads = []
        with torch.inference_mode():
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for name, graph in graphs.items():
                    int_linear.REDUCED_ROWS = BOUNDS[name]  # the value each graph was compiled with (a guard)
                    graph.run(ids, slots, cached)
                    times = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        graph.run(ids, slots, cached)
                        times.append(time.perf_counter() - t0)
                    medians[name].append(statistics.median(times))
        ms = {name: 1e3 * statistics.median(v) for name, v in medians.items()}
        print(
            f"batch={b} kernel_ms={ms['kernel']:.3f} reduced_ms={ms['reduced']:.3f} "
            f"speedup={ms['kernel'] / ms['reduced']:.2f} load={max(loads):.1f}",
            flush=True,
        )
        assert sum(g.compiles for g in graphs.values()) == len(graphs), "a decode graph recompiled while timed"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
