"""flashnext's serving engine vs the transformers reference's `generate`: greedy generation tok/s, same run.

Config: the ~31M-param config of `model_vs_reference.py` (hidden 256, 8 layers with 2 QSA, 16 experts top-4,
PLE on 2 layers, budget 128 / compress 4, vocab 16384), fp32, CPU, 2 threads. The reference is built with every
weight randomised and saved in the official layout; ours loads that checkpoint with `flashnext.from_pretrained`.

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

Output:
    batch=<b> ours=<tok/s> ref=<tok/s> ratio=<x>
    http concurrency=<c> tok/s=<x> ttft_ms=<median> tpot_ms=<median>
    # gemm floor batch=16: <ms>/step of matmuls; ref <ms>/step; ratio bound <x>
    batch16_ratio=<x>            (last line)

    python benchmarks/serve_vs_reference.py
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


def ours_generate(model, prompts: torch.Tensor) -> list[list[int]]:
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    engine = Engine(model, max_slots=prompts.shape[0], max_model_len=PROMPT_LEN + NEW_TOKENS + 1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts.tolist(), params)]


def bench_decode(
    ours, ref, batches: list[int], repeats: int, vocab: int, seed: int
) -> tuple[dict[int, float], dict[int, float]]:
    """Per batch: (ref time / our time, reference seconds per generated position)."""
    gen = torch.Generator().manual_seed(seed)
    ratios, ref_step = {}, {}
    for b in batches:
        prompts = torch.randint(0, vocab, (b, PROMPT_LEN), generator=gen)
        times = {"ours": [], "ref": []}
        outs = {}
        fns = {"ours": lambda p=prompts: ours_generate(ours, p), "ref": lambda p=prompts: reference_generate(ref, p)}
        for _ in range(repeats):
            for name, fn in fns.items():
                start = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - start)
        t = {k: statistics.median(v) for k, v in times.items()}
        same = sum(a == r for a, r in zip(outs["ours"], outs["ref"], strict=True))
        ratios[b] = t["ref"] / t["ours"]
        ref_step[b] = t["ref"] / NEW_TOKENS
        tokens = b * NEW_TOKENS
        print(f"# batch={b} identical greedy sequences: {same}/{b}")
        print(f"batch={b} ours={tokens / t['ours']:.1f} ref={tokens / t['ref']:.1f} ratio={ratios[b]:.2f}", flush=True)
    return ratios, ref_step


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
    with torch.inference_mode():  # the recorded operands are the step's inference tensors (and their clones)
        for _ in range(repeats):
            start = time.perf_counter()
            for func, args, kwargs in calls:
                func(*args, **kwargs)
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
    ref = harness.build_reference(dict(cfg), seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="flashnext-serve-bench-") as tmp:
        ref.save_pretrained(tmp)
        ours = flashnext.from_pretrained(tmp, dtype=torch.float32, device="cpu").eval()
    n = sum(p.numel() for p in ours.parameters())
    policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    print(
        f"# params={n / 1e6:.2f}M fp32 threads={torch.get_num_threads()} prompt={PROMPT_LEN} new={NEW_TOKENS} "
        f"omp_wait_policy={policy}"
    )
    ratios, ref_step = bench_decode(ours, ref, args.batches, args.repeats, cfg["vocab_size"], args.seed)
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
    last = ratios.get(16)
    print(f"batch16_ratio={last:.2f}" if last is not None else "batch16_ratio=nan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
