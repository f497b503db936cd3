"""flashnext's serving engine vs the transformers reference's `generate`: greedy generation tok/s, same run.

Config: the ~31M-param config of `model_vs_reference.py` (hidden 256, 8 layers with 2 QSA, 16 experts top-4,
PLE on 2 layers, budget 128 / compress 4, vocab 16384), CPU, 2 threads, in `--dtype` (float32 or bfloat16: both
sides in that dtype, the reference loaded with `from_pretrained(dtype=...)` from the same checkpoint). The reference
is built with every weight randomised and saved in the official layout; ours loads that checkpoint with
`flashnext.from_pretrained`. `--decode-graph` also times a second engine whose decode-only steps run as the
compiled decode step (`serve.decode_graph`; its one-off compile time per bucket is printed, not timed), in the
same alternation as the eager engine and the reference.

Decode throughput: for batch b in 1, 4, 16, b prompts of 32 random tokens, 64 new tokens each, greedy, EOS off.
Both sides do the same work (prefill of the prompts, then 64 tokens); tok/s = b * 64 / wall seconds. The
reference runs `generate` on the [b, 32] batch (no padding: equal lengths); ours runs `Engine.generate` with b
slots. Runs alternate ours/ref (median of `--repeats`), and the generated tokens are compared.

HTTP load (unless `--no-http`): `flashnext serve`'s app on 127.0.0.1 (uvicorn in a thread), concurrency c in
1, 4, 16, 64: c streaming /v1/completions clients (32-token prompts, 64 tokens) at once, run by `load_client.py`
in a separate process (as a real client is; sharing this process's GIL inflated TPOT); prints output tok/s and
the medians of time-to-first-token and time-per-output-token.

OpenMP waiting (`--omp-wait-policy`, applied to both sides, set before torch loads): `default` leaves libgomp's
spin-then-sleep; `passive` suits a shared box, where spinning threads lost their time slices and every small op of
both sides ran ~4x slower; on a quiet box `passive` made our decode step ~25% slower (each GEMM wakes the worker).

GEMM floor (batch 16): the matmuls of one of our batch-16 decode steps (recorded with their shapes and operands)
replayed back to back, against the reference's wall time per generated position. On a CPU this bounds the ratio
that removing every other cost could reach: `bound = ref ms per step / GEMM ms per step`.

Weight-streaming floor (each batch): a decode step must read every weight it uses once: the dense weights (all
but the token embedding and the n-gram tables, of which it gathers a few rows) plus the experts the batch touches
(expected count E * (1 - (1 - k/E)^b)). `floor = those bytes / measured read bandwidth` (a `sum` over a 512 MiB
tensor, best of 5, same threads) is what no implementation can beat on this machine; our decode step (median of
the decode-only steps of one generation, prefill excluded) is printed against it.

Machine load (`os.getloadavg`) is printed beside each timed line: on a shared box, numbers taken at load above the
thread count are noise, not results.

Output:
    batch=<b> ours=<tok/s> ref=<tok/s> ratio=<x> load=<1-min load>
    batch=<b> graph=<tok/s> ref=<tok/s> ratio=<x> load=<1-min load>          (with --decode-graph)
    # floor batch=<b>: weights <MB>/step at <GB/s> -> <ms>/step; <ours|graph> decode step <ms> (<x> x floor)
    http concurrency=<c> tok/s=<x> ttft_ms=<median> tpot_ms=<median>
    # gemm floor batch=16: <ms>/step of matmuls; ref <ms>/step; ratio bound <x>
    batch16_ratio=<x>            (last line)

    python benchmarks/serve_vs_reference.py
    python benchmarks/serve_vs_reference.py --dtype bfloat16 --decode-graph --no-http
    python benchmarks/serve_vs_reference.py --batches 1 4 --repeats 1 --no-http
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _omp_policy(argv) -> None:
    """Apply `--omp-wait-policy` before torch (and its OpenMP runtime) loads; both sides run under it."""
    argv = sys.argv[1:] if argv is None else argv
    policy = "default"
    for i, arg in enumerate(argv):
        if arg.startswith("--omp-wait-policy"):
            policy = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
    if policy != "default" and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = policy.upper()


_omp_policy(None if __name__ == "__main__" else [])

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT_LEN = 32
NEW_TOKENS = 64


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_generate(ref, prompts: torch.Tensor) -> list[list[int]]:
    out = ref.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, prompts.shape[1] :].tolist()


def make_engine(model, batch: int, decode_graph: bool):
    """Our engine for `batch` prompts; with the decode graph, its bucket compiled now (untimed, printed)."""
    from flashnext.serve.engine import Engine

    engine = Engine(
        model, max_slots=batch, max_model_len=PROMPT_LEN + NEW_TOKENS + 1, decode_graph=decode_graph,
        decode_buckets=[batch],
    )  # fmt: skip
    if decode_graph:
        took = engine.decode_graph.warmup()[batch]
        print(f"# decode graph batch={batch}: compiled in {took:.1f} s", flush=True)
    return engine


def ours_generate(engine, prompts: torch.Tensor, step_times: list[float] | None = None) -> list[list[int]]:
    """Greedy generation through `engine`; the wall time of every decode-only step is appended to `step_times`."""
    from flashnext.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts.tolist()]
    while engine.has_unfinished():
        prefilling = any(r.num_cached < len(r.prompt_ids) for r in engine.running) or engine.waiting
        start = time.perf_counter()
        engine.step()
        if step_times is not None and not prefilling:
            step_times.append(time.perf_counter() - start)
    return [r.output_ids for r in reqs]


def bench_decode(ours, ref, args, vocab: int) -> tuple[dict, dict, dict]:
    """(ref time / our time, our decode step seconds) keyed by (engine, batch), engine "ours" (eager steps) and,
    with `--decode-graph`, "graph" (the compiled decode step); and the reference's seconds per generated position
    keyed by batch. Both engines and the reference alternate in one loop, under the same load."""
    gen = torch.Generator().manual_seed(args.seed)
    ratios, ref_step, our_step = {}, {}, {}
    engines = ["ours", "graph"] if args.decode_graph else ["ours"]
    for b in args.batches:
        prompts = torch.randint(0, vocab, (b, PROMPT_LEN), generator=gen).to(args.device)
        built = {name: make_engine(ours, b, name == "graph") for name in engines}
        times, outs, loads = {name: [] for name in [*engines, "ref"]}, {}, []
        steps = {name: [] for name in engines}
        fns = {name: lambda p=prompts, e=e, st=steps[name]: ours_generate(e, p, st) for name, e in built.items()}
        fns["ref"] = lambda p=prompts: reference_generate(ref, p)
        for _ in range(args.repeats):
            for name, fn in fns.items():
                loads.append(os.getloadavg()[0])
                start = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - start)
        t = {k: statistics.median(v) for k, v in times.items()}
        ref_step[b] = t["ref"] / NEW_TOKENS
        tokens = b * NEW_TOKENS
        for name in engines:
            same = sum(a == r for a, r in zip(outs[name], outs["ref"], strict=True))
            ratios[name, b] = t["ref"] / t[name]
            our_step[name, b] = statistics.median(steps[name])
            print(f"# batch={b} {name}: identical greedy sequences {same}/{b}")
            print(
                f"batch={b} {name}={tokens / t[name]:.1f} ref={tokens / t['ref']:.1f} ratio={ratios[name, b]:.2f} "
                f"load={max(loads):.1f}",
                flush=True,
            )
    return ratios, ref_step, our_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, mib: int = 512) -> float:
    """Bytes/s of a `sum` over a `mib` MiB fp32 tensor (best of 5, current threads): the weight-streaming rate."""
    x = torch.ones(mib * 2**18, device=device)
    x.sum()
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def weight_bytes(model, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens reads: every parameter but the token embedding and the
    n-gram tables (rows gathered), with the routed experts counted at the expected fraction the batch touches."""
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = 1 - (1 - k / E) ** batch
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or "ngram_embedding" in name:
            continue
        share = touched if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else 1.0
        total += p.numel() * p.element_size() * share
    return total


def print_floor(model, our_step: dict[tuple[str, int], float]) -> None:
    bw = read_bandwidth(next(model.parameters()).device)
    for (name, b), step in our_step.items():
        nbytes = weight_bytes(model, b)
        floor = nbytes / bw
        print(
            f"# floor batch={b}: weights {nbytes / 1e6:.1f} MB/step at {bw / 1e9:.1f} GB/s -> "
            f"{floor * 1e3:.2f} ms/step; {name} decode step {step * 1e3:.2f} ms ({step / floor:.1f} x floor) "
            f"load={os.getloadavg()[0]:.1f}",
            flush=True,
        )


def gemm_floor(model, batch: int, vocab: int, seed: int, repeats: int = 20) -> float:
    """Median seconds of the matmuls of one of our decode steps at `batch`, replayed alone back to back."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    ops = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.baddbmm.out}  # fmt: skip
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in ops:
                copy = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                calls.append(
                    (func, copy, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
                )
            return func(*args, **kwargs)

    gen = torch.Generator().manual_seed(seed)
    engine = Engine(model, max_slots=batch, max_model_len=PROMPT_LEN + NEW_TOKENS + 1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt in torch.randint(0, vocab, (batch, PROMPT_LEN), generator=gen).tolist():
        engine.add_request(prompt, params)
    for _ in range(1 + NEW_TOKENS // 2):  # prefill, then decode to mid-generation
        engine.step()
    with Record():
        engine.step()
    times = []
    device = next(model.parameters()).device
    with torch.inference_mode():  # the recorded operands are the step's inference tensors (and their clones)
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for func, args, kwargs in calls:
                func(*args, **kwargs)
            _sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _serve_in_thread(app):
    """uvicorn on a free 127.0.0.1 port in a daemon thread -> (base url, server)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


def http_load(model, concurrencies: list[int], vocab: int, seed: int) -> list[str]:
    """Streaming /v1/completions at each concurrency (clients in a separate process: `load_client.py`); output
    tok/s, median TTFT and TPOT."""
    import json
    import subprocess

    from flashnext.serve.engine import Engine
    from flashnext.serve.server import build_app

    engine = Engine(model, None, max_slots=max(concurrencies), max_model_len=PROMPT_LEN + NEW_TOKENS + 1)
    base, server = _serve_in_thread(build_app(engine, "bench"))
    gen = torch.Generator().manual_seed(seed + 1)
    lines = []
    for c in concurrencies:
        prompts = torch.randint(0, vocab, (c, PROMPT_LEN), generator=gen).tolist()
        job = {"url": f"{base}/v1/completions", "prompts": prompts, "max_tokens": NEW_TOKENS}
        proc = subprocess.run(
            [sys.executable, str(HERE / "load_client.py")], input=json.dumps(job), capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"load client failed at concurrency {c}:\n{proc.stderr[-2000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        wall = max(r[3] for r in res)
        toks = sum(r[2] for r in res)
        ttft = statistics.median(r[0] for r in res) * 1000
        tpot = statistics.median(r[1] for r in res) * 1000
        line = f"http concurrency={c} tok/s={toks / wall:.1f} ttft_ms={ttft:.1f} tpot_ms={tpot:.1f}"
        print(line, flush=True)
        lines.append(line)
    server.should_exit = True
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch (median; default 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP load run")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' dtype")
    parser.add_argument("--device", default="cpu", help="both sides' device (default cpu; cuda: a GPU run)")
    parser.add_argument(
        "--decode-graph",
        action="store_true",
        help="also time our engine with the compiled decode step (one bucket per batch), alternating with the eager "
        "engine and the reference",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=["default", "active", "passive"],
        default="default",
        help="OpenMP waiting for both sides (default: libgomp's own; an OMP_WAIT_POLICY already set wins)",
    )
    args = parser.parse_args(argv)

    import flashnext

    torch.set_num_threads(args.threads)
    cfg = _load("model_vs_reference", HERE / "model_vs_reference.py").CONFIG
    harness = _load("flashnext_reference_harness", HERE.parent / "tests" / "reference" / "conftest.py")
    dtype = getattr(torch, args.dtype)
    ref = harness.build_reference(dict(cfg), seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="flashnext-serve-bench-") as tmp:
        ref.save_pretrained(tmp)
        ours = flashnext.from_pretrained(tmp, dtype=dtype, device=args.device).eval()
        if dtype != torch.float32:  # the reference in the same dtype, from the same checkpoint
            ref = type(ref).from_pretrained(tmp, dtype=dtype, attn_implementation="eager").eval()
    ref = ref.to(args.device)
    n = sum(p.numel() for p in ours.parameters())
    policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    print(
        f"# params={n / 1e6:.2f}M {args.dtype} threads={torch.get_num_threads()} prompt={PROMPT_LEN} "
        f"new={NEW_TOKENS} omp_wait_policy={policy} decode_graph={args.decode_graph} load={os.getloadavg()[0]:.1f}"
    )
    ratios, ref_step, our_step = bench_decode(ours, ref, args, cfg["vocab_size"])
    print_floor(ours, our_step)
    if 16 in ref_step:
        floor = gemm_floor(ours, 16, cfg["vocab_size"], args.seed)
        print(
            f"# gemm floor batch=16: {floor * 1e3:.2f} ms/step of matmuls; ref {ref_step[16] * 1e3:.2f} ms/step; "
            f"ratio bound {ref_step[16] / floor:.2f}",
            flush=True,
        )
    if not args.no_http:
        del ref
        http_load(ours, args.concurrency, cfg["vocab_size"], args.seed)
    last = ratios.get(("graph", 16), ratios.get(("ours", 16)))
    print(f"batch16_ratio={last:.2f}" if last is not None else "batch16_ratio=nan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
