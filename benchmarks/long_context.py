"""One 131,072-token sequence on one box: chunked prefill of the 31M benchmark config through the serving path.

The model is `benchmarks/model_vs_reference.py`'s config (hidden 256, 8 layers: 6 Gated DeltaNet + 2 QSA with budget
128 / compress 4, PLE on 2 layers, 16 experts top-4, vocab 16384), randomly initialised in fp32. The prompt is fed to
`serve.Engine` (one slot, `--chunk` tokens per step, greedy, one generated token): every step continues the
sequence's GDN/PLE windows and recurrent state and appends to its QSA keys, values and block keys in the
`StateCache`, so memory is the model, the cache (O(L) keys/values of the 2 QSA layers) and one chunk's
activations; no L x L mask or L-row logits ever exist (the reference builds dense S x S masks).

Before the long run, `--check` tokens are prefilled the same way and the engine's log-prob of its first token is
compared with a plain full forward of the same prompt (the serving path is the training math).

Output (the last line is the result; peak RSS is the process's high-water mark, model and imports included):
    # check_len=<n> logprob_engine=<x> logprob_forward=<y>
    # chunk <i>/<n> tokens=<t> elapsed_s=<s> rss_gib=<g>        (every --report steps)
    prefill_131k_s=<x> peak_rss_gib=<y>

    python benchmarks/long_context.py                      # 131,072 tokens, 4096-token chunks
    python benchmarks/long_context.py --tokens 16384        # a quick projection (QSA scoring grows as L^2)
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import time
from pathlib import Path

import torch

from flashnext.build import build_model
from flashnext.config import parse_config
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def benchmark_config():
    """The 31M config of `benchmarks/model_vs_reference.py` (one source of truth for both benchmarks)."""
    spec = importlib.util.spec_from_file_location("model_vs_reference", ROOT / "benchmarks" / "model_vs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return parse_config(dict(module.CONFIG)).text


def rss_gib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def prefill(model, ids: list[int], chunk: int, report: int = 0) -> tuple[float, float]:
    """Chunked prefill of `ids` plus one greedy token; returns (seconds, log-prob of that token)."""
    engine = Engine(model, None, max_slots=1, max_model_len=len(ids) + 2, max_num_batched_tokens=chunk)
    req = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=0))
    t0, steps, total = time.perf_counter(), 0, -(-len(ids) // chunk)
    while not req.finished:
        engine.step()
        steps += 1
        if report and (steps % report == 0 or req.finished):
            print(f"# chunk {steps}/{total} tokens={min(steps * chunk, len(ids))} "
                  f"elapsed_s={time.perf_counter() - t0:.1f} rss_gib={rss_gib():.2f}", flush=True)  # fmt: skip
    return time.perf_counter() - t0, req.completion(False).logprobs[0]


@torch.no_grad()
def full_forward_logprob(model, ids: list[int]) -> float:
    """Log-prob of the greedy next token after `ids`, from one plain forward over the whole prompt."""
    logits = model(torch.tensor(ids)).logits[-1].float()
    return float(torch.log_softmax(logits, -1).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--chunk", type=int, default=4096, help="prompt tokens per engine step")
    parser.add_argument("--check", type=int, default=2048, help="tokens of the engine-vs-forward check (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--report", type=int, default=4, help="progress line every N steps (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = benchmark_config()
    model = build_model(cfg, seed=0, dtype=torch.float32, device="cpu").eval()
    ids = torch.randint(3, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"# config hidden={cfg.hidden_size} layers={cfg.num_hidden_layers} budget={cfg.indexer_budget} "
          f"compress={cfg.indexer_compress_ratio} params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"tokens={args.tokens} chunk={args.chunk} threads={args.threads}")  # fmt: skip
    if args.check:
        _, lp_engine = prefill(model, ids[: args.check], min(args.chunk, 512))
        lp_forward = full_forward_logprob(model, ids[: args.check])
        print(f"# check_len={args.check} logprob_engine={lp_engine:.6f} logprob_forward={lp_forward:.6f}")
        assert abs(lp_engine - lp_forward) <= 1e-3 * max(1.0, abs(lp_forward)), "serving prefill != full forward"
    seconds, _ = prefill(model, ids, args.chunk, args.report)
    print(f"prefill_{round(args.tokens / 1000)}k_s={seconds:.1f} peak_rss_gib={rss_gib():.2f}")


if __name__ == "__main__":
    main()
