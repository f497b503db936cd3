"""The prepared GPU check: run it once on a machine with CUDA (never a test or CI dependency).

    python scripts/gpu_check.py                 # all checks, then the two benchmarks (~5 min on one GPU)
    python scripts/gpu_check.py --no-bench      # the checks only

Checks (each prints PASS/FAIL with what it measured; the exit status is 1 if any failed), on the ~31M benchmark
config of `benchmarks/model_vs_reference.py` with seeded random weights:
1. cuda-vs-cpu: the full forward's logits on CUDA fp32 against CPU fp32 (a packed stream of three sequences,
   crossing QSA blocks and the indexer budget), TF32 off; relative error (max |diff| / max |cpu|) <= 1e-4.
2. fla: with flash-linear-attention installed, the same forward with FLA's chunked delta rule against our chunked
   kernel on CUDA (`FLASHNEXT_FORCE_REF=1`); <= 1e-4 (skipped, and said so, without FLA).
3. serving: our engine on CUDA against our engine on CPU, greedy, fp32, 4 prompts x 32 new tokens: the tokens
   equal and the log-probs within 1e-3 (GPU reductions round differently; a near-tie may flip a token, reported).
4. cuda-graph: the engine with its decode steps captured as CUDA graphs (`decode_graph=True`) against the eager
   engine on CUDA: equal tokens, log-probs within 1e-4, one capture per bucket used; then an in-place weight update
   is seen by the next replay (logits equal the eager step's after it).
5. bf16: the engine in bf16 on CUDA (cache bf16, GDN state fp32) runs, and its log-probs stay within 0.5 of fp32's.
Then the benchmarks: `benchmarks/serve_vs_reference.py --device cuda` (fp32 and bf16, with and without the decode
graph) and `benchmarks/model_vs_reference.py` when it accepts `--device`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[tuple[str, bool, str]] = []


def _config() -> dict:
    spec = importlib.util.spec_from_file_location("model_vs_reference", ROOT / "benchmarks" / "model_vs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.CONFIG)


def _model(cfg: dict, device: str, dtype=torch.float32):
    from flashnext.build import build_model
    from flashnext.config import parse_config

    return build_model(parse_config(cfg).text, seed=0, dtype=dtype, device=device)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check(name: str):
    """Run a check function, record PASS/FAIL (an exception is a failure with its traceback)."""

    def wrap(fn):
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # a check that crashes fails; the others still run
            ok, detail = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        RESULTS.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - start:.1f}s): {detail}", flush=True)
        return fn

    return wrap


def _packed(cfg: dict):
    gen = torch.Generator().manual_seed(1)
    lengths = [40, 150, 300]
    ids = torch.randint(0, cfg["vocab_size"], (sum(lengths),), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


def _logits(model, ids, cu):
    dev = next(model.parameters()).device
    with torch.no_grad():
        return model(ids.to(dev), cu_seqlens=cu.to(dev)).logits.float().cpu()


def run_checks(cfg: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu, gpu = _model(cfg, "cpu"), _model(cfg, "cuda")
    ids, cu = _packed(cfg)
    base = _logits(cpu, ids, cu)

    @check("cuda-vs-cpu")
    def _():
        os.environ["FLASHNEXT_FORCE_REF"] = "1"
        try:
            err = _rel(_logits(gpu, ids, cu), base)
        finally:
            os.environ.pop("FLASHNEXT_FORCE_REF")
        return err <= 1e-4, f"logits rel. error {err:.2e} (tol 1e-4)"

    @check("fla")
    def _():
        try:
            import fla.ops.gated_delta_rule  # noqa: F401
        except ImportError:
            return True, "SKIPPED: flash-linear-attention is not installed (pip install '.[gpu]')"
        fla_logits = _logits(gpu, ids, cu)
        os.environ["FLASHNEXT_FORCE_REF"] = "1"
        try:
            ours = _logits(gpu, ids, cu)
        finally:
            os.environ.pop("FLASHNEXT_FORCE_REF")
        err = _rel(fla_logits, ours)
        return (
            err <= 1e-4,
            f"FLA vs our chunked kernel on CUDA: rel. error {err:.2e} (tol 1e-4); vs CPU {_rel(fla_logits, base):.2e}",
        )

    serving_checks(cfg, cpu, gpu)


def _generate(model, prompts, n=32, **engine_kwargs):
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    engine = Engine(model, max_slots=len(prompts), max_model_len=128, **engine_kwargs)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    return engine, engine.generate(prompts, params)


def _compare(outs_a, outs_b) -> tuple[int, float]:
    """(sequences with equal tokens, max |log-prob diff| over the common prefix of each pair)."""
    same, worst = 0, 0.0
    for a, b in zip(outs_a, outs_b, strict=True):
        same += a.token_ids == b.token_ids
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        n = min(n + 1, len(a.token_ids))  # the first differing position's log-probs are still comparable
        if n:
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n], strict=True)))
    return same, worst


def serving_checks(cfg: dict, cpu, gpu) -> None:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen).tolist() for n in (7, 32, 13, 50)]
    _, eager_gpu = _generate(gpu, prompts)

    @check("serving")
    def _():
        _, on_cpu = _generate(cpu, prompts)
        same, worst = _compare(eager_gpu, on_cpu)
        return same == len(prompts) and worst <= 1e-3, f"{same}/{len(prompts)} equal; log-prob diff {worst:.2e}"

    @check("cuda-graph")
    def _():
        from flashnext.serve.sampling import SamplingParams

        engine, graphed = _generate(gpu, prompts, decode_graph=True, decode_buckets=[1, 2, 4])
        same, worst = _compare(graphed, eager_gpu)
        captures = engine.decode_graph.compiles
        ok = same == len(prompts) and worst <= 1e-4 and captures <= 3
        detail = f"{same}/{len(prompts)} equal; log-prob diff {worst:.2e}; captures {captures}"
        with torch.no_grad():
            gpu.lm_head.weight.mul_(1.25)  # in place: the graphs captured above must read the new values
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
            after = engine.generate(prompts, params)  # the same engine: its captured graphs replayed
            _, after_eager = _generate(gpu, prompts, n=8)
        finally:
            with torch.no_grad():
                gpu.lm_head.weight.div_(1.25)
        same2, worst2 = _compare(after, after_eager)
        recaptured = engine.decode_graph.compiles - captures
        detail += f"; after an in-place update {same2}/{len(prompts)} equal, diff {worst2:.2e}, recaptures {recaptured}"
        return ok and same2 == len(prompts) and worst2 <= 1e-4 and recaptured == 0, detail

    @check("bf16")
    def _():
        engine, outs = _generate(_model(cfg, "cuda", torch.bfloat16), prompts, decode_graph=True)
        state_dtype = engine.cache.layers[0]["linear_attn"].recurrent.dtype
        _, worst = _compare(outs, eager_gpu)
        return (
            state_dtype == torch.float32 and worst <= 0.5,
            f"GDN state {state_dtype}; log-prob diff vs fp32 {worst:.3f}",
        )


def run_benchmarks() -> None:
    bench = ROOT / "benchmarks"
    runs = [
        ["serve_vs_reference.py", "--device", "cuda", "--no-http", "--batches", "1", "16"],
        ["serve_vs_reference.py", "--device", "cuda", "--no-http", "--batches", "1", "16", "--decode-graph"],
        ["serve_vs_reference.py", "--device", "cuda", "--no-http", "--batches", "1", "16", "--decode-graph",
         "--dtype", "bfloat16"],
    ]  # fmt: skip
    help_text = subprocess.run(
        [sys.executable, str(bench / "model_vs_reference.py"), "--help"], capture_output=True, text=True
    ).stdout
    if "--device" in help_text:
        runs.append(["model_vs_reference.py", "--device", "cuda"])
    else:
        print("# model_vs_reference.py has no --device: not run on the GPU", flush=True)
    for run in runs:
        print(f"# {' '.join(run)}", flush=True)
        proc = subprocess.run([sys.executable, str(bench / run[0]), *run[1:]], timeout=900)
        RESULTS.append((" ".join(run), proc.returncode == 0, f"exit {proc.returncode}"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-bench", action="store_true", help="the checks only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check", file=sys.stderr)
        return 2
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    run_checks(_config())
    if not args.no_bench:
        run_benchmarks()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(
        f"# {len(RESULTS) - len(failed)}/{len(RESULTS)} passed" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
