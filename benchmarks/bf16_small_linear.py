"""Candidate kernels for a bf16 product of a few rows on CPU, against fp32 `F.linear` (issue 31 item 1).

    python benchmarks/bf16_small_linear.py [--rows 1 4 16] [--threads 1]

Shapes: the projections of `vs_llamacpp.py`'s config in a serving step (`model/fused.py`'s prepared path): a GDN
layer's fused in-projection (784 x 256), QSA's with the indexer (1344 x 256), an output projection (256 x 256), the
LM head (4096 x 256). Candidates, each on the same weights, alternated in rounds (best of `--rounds`):
- `bf16_linear`: stock `F.linear` in bf16 (oneDNN); `bf16_w_xt`: `W @ x.T` (`fused.linear`'s skinny form);
- `fp32_copy`: the prepared path's fp32 copy (`fused.FP32_COPY_MAX`): `F.linear(x.float(), W32).bfloat16()`;
- `onednn_packed`: oneDNN with the weight prepacked (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`);
  an MKLDNN-layout tensor cannot be an inductor graph input, so it is eager only;
- `mkl_packed_fp32`: MKL's packed fp32 GEMM (`mkl._mkl_reorder_linear_weight`, `mkl._mkl_linear`);
- `inductor_reduction`: the product as a compiled reduction with fp32 accumulation.
Times are the calling thread's CPU time (`time.thread_time`) per call, which a loaded machine disturbs less than
wall time (with `--threads 1`); the ratio is to fp32 `F.linear` on the same shapes. The 1-min load is printed.

Output:
    N=<n> K=<k> rows=<m> load=<l> fp32_linear=<us> <candidate>=<us>(<ratio>) ...
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

SHAPES = [(784, 256), (1344, 256), (256, 256), (4096, 256)]


def per_call_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    start = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - start) / n * 1e6


def reduction(x, w):
    return (w.unsqueeze(0).float() * x.unsqueeze(1).float()).sum(-1).to(x.dtype)


def make_candidates(n_out: int, k: int, m: int, compiled) -> dict:
    """name -> a call of that candidate on one random weight [n_out, k] and input [m, k]."""
    w32, x32 = torch.randn(n_out, k) / k**0.5, torch.randn(m, k)
    wb, xb = w32.bfloat16(), x32.bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, m)
    mkl = torch.ops.mkl._mkl_reorder_linear_weight(w32, m)
    wc = wb.float()
    return {
        "fp32_linear": lambda: F.linear(x32, w32),
        "bf16_linear": lambda: F.linear(xb, wb),
        "bf16_w_xt": lambda: torch.mm(wb, xb.t()),
        "fp32_copy": lambda: F.linear(xb.float(), wc).bfloat16(),
        "onednn_packed": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""),
        "mkl_packed_fp32": lambda: torch.ops.mkl._mkl_linear(x32, mkl, w32, None, m),
        "inductor_reduction": lambda: compiled(xb, wb),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(reduction, dynamic=False, fullgraph=True)
    for n_out, k in SHAPES:
        for m in args.rows:
            candidates = make_candidates(n_out, k, m, compiled)
            times = {name: [] for name in candidates}
            for _ in range(args.rounds):
                for name, fn in candidates.items():
                    times[name].append(per_call_us(fn, args.calls))
            best = {name: min(t) for name, t in times.items()}
            base = best["fp32_linear"]
            cells = " ".join(f"{name}={t:.1f}({t / base:.2f})" for name, t in best.items() if name != "fp32_linear")
            load = os.getloadavg()[0]
            print(f"N={n_out} K={k} rows={m} load={load:.1f} fp32_linear={base:.1f} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
