"""Cost of penalties and logit controls in the sampler (`serve.logit_controls`), at the real model's vocabulary.

`Sampler.sample` on random fp32 logits [b, V] (V = 248,320, Qwen3.8-Flash-Next's), greedy, for b in 1, 16, 64:
plain rows vs rows that all set frequency, presence and repetition penalties, a `logit_bias` entry and
`min_tokens` (still in force). Each request has a 2,000-token prompt of its own ids and `--history` generated
tokens; every call appends one token per request first, so the incremental count update is in the time. Plain and
controlled calls alternate in every repeat (a shared box's load drifts); one intra-op thread unless `--threads`;
printed: median ms per call of each and
the median of the per-repeat ratios.

Output:
    batch=<b> plain_ms=<x> controlled_ms=<y> ratio=<r>
    controls_ratio_b1=<x> controls_ratio_b16=<y> controls_ratio_b64=<z>      (last line)

    python benchmarks/logit_controls.py
    python benchmarks/logit_controls.py --repeats 5 --history 1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flashnext.serve.request import Request
from flashnext.serve.sampler import Sampler
from flashnext.serve.sampling import SamplingParams

V = 248_320


def _requests(b: int, controlled: bool, history: int) -> list[Request]:
    extra = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, logit_bias={5: 2.0},
                 min_tokens=10**6, max_tokens=10**6) if controlled else {}  # fmt: skip
    reqs = []
    for i in range(b):
        r = Request(str(i), [(i * 2_000 + j) % V for j in range(2_000)], SamplingParams(temperature=0.0, **extra))
        r.output_ids = [(i * 7 + j * 13) % V for j in range(history)]
        reqs.append(r)
    return reqs


def _ms_per_call(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], calls: int) -> float:
    start = time.perf_counter()
    for step in range(calls):
        for r in reqs:
            r.output_ids.append((step * 31 + len(r.output_ids)) % V)
        sampler.sample(logits, reqs)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10, help="sample calls per measurement")
    ap.add_argument("--history", type=int, default=500, help="generated tokens per request before timing")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ratios = {}
    for b in (1, 16, 64):
        logits = torch.randn(b, V)
        plain, ctl, ratio = [], [], []
        for _ in range(args.repeats):
            runs = {}
            for controlled in (False, True):
                sampler, reqs = Sampler(None, 2, 10**9), _requests(b, controlled, args.history)
                sampler.sample(logits, reqs)  # the table's first allocation out of the timing
                runs[controlled] = _ms_per_call(sampler, logits, reqs, args.calls)
            plain.append(runs[False])
            ctl.append(runs[True])
            ratio.append(runs[True] / runs[False])
        ratios[b] = statistics.median(ratio)
        print(f"batch={b} plain_ms={statistics.median(plain):.2f} controlled_ms={statistics.median(ctl):.2f} "
              f"ratio={ratios[b]:.2f}")  # fmt: skip
    print(" ".join(f"controls_ratio_b{b}={r:.2f}" for b, r in ratios.items()))


if __name__ == "__main__":
    main()
