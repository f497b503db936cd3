"""Ways to run the int8 routed experts of one layer in a compiled static decode step, timed alternately.

    python benchmarks/int8_experts.py [--experts 16] [--threads 2] [--rounds 30]

Experts of the benchmark config (`model_vs_reference.py`: hidden 256, width 128, top-4), int8 per output channel
(`QuantExperts.from_float`), decode batches of 1 and 16 tokens, every candidate compiled by inductor
(`fullgraph=True, dynamic=False`) as the decode graph compiles the step:
- kernels: the packed `_weight_int8pack_mm` per expert (what the static step ran before `_reduced`: the gather
  path's per-assignment calls at 1 token, `_dense`'s every-expert calls at 16);
- fused: `QuantExperts.forward` in a static step, i.e. `_reduced` (int8 rows gathered and upcast inside one fp32
  reduction);
- dense_fused: every expert on every token with the upcast fused into the reduction (no gather, E/k x the FLOPs);
- dequant_bmm: every expert dequantised to fp32 (materialised), then two batched GEMMs;
- float_reduced: `Experts._reduced` on the fp32 weights (what the fp32 model runs; 4x the bytes).
Each round times 10 calls of each candidate in turn; the best round is kept (the box is shared: the minimum is the
least disturbed). Also printed: each candidate's max error against `experts_ref`, relative to the output's scale.

Output, per batch:
    tokens=<T> load=<1-min load> <candidate>=<us per layer>(<ratio to kernels>) ...
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from flashnext.model.moe import Experts
from flashnext.quant.int_experts import QuantExperts, experts_ref

D, I, K = 256, 128, 4


def candidates(q: QuantExperts, fe: Experts) -> dict:
    E = q.num_experts

    def kernels(x, ex, w):
        xc = x.to(q.gate_up_s.dtype)
        if ex.numel() * 2 < E:
            return q._gathered(xc, ex.flatten(), w).float()
        return q._dense(xc, ex, w).float()

    def fused(x, ex, w):
        return q(x, ex, w, fused=True, static=True)

    def dense_fused(x, ex, w):
        T = x.shape[0]
        g = (q.gate_up_q.float()[None] * x[:, None, None, :]).sum(-1) * q.gate_up_s.float()  # [T, E, 2I]
        gate, up = g.chunk(2, -1)
        o = (q.down_q.float()[None] * (F.silu(gate) * up)[:, :, None, :]).sum(-1) * q.down_s.float()  # [T, E, D]
        return (o * torch.zeros(T, E).scatter(1, ex, w)[..., None]).sum(1)

    def dequant_bmm(x, ex, w):
        T = x.shape[0]
        gu = q.gate_up_q.float() * q.gate_up_s.float()[..., None]
        dn = q.down_q.float() * q.down_s.float()[..., None]
        gate, up = torch.bmm(gu, x.t().unsqueeze(0).expand(E, D, T)).chunk(2, 1)  # [E, I, T] each
        o = torch.bmm((F.silu(gate) * up).transpose(1, 2), dn.transpose(1, 2))  # [E, T, D]
        return (o * torch.zeros(T, E).scatter(1, ex, w).t()[..., None]).sum(0)

    def float_reduced(x, ex, w):
        return fe._reduced(x, ex.flatten(), w)

    return dict(kernels=kernels, fused=fused, dense_fused=dense_fused, dequant_bmm=dequant_bmm,
                float_reduced=float_reduced)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    E = args.experts
    fe = Experts(SimpleNamespace(num_experts=E, hidden_size=D, moe_intermediate_size=I))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        fe.gate_up_proj.copy_(torch.randn(fe.gate_up_proj.shape, generator=gen) * 0.05)
        fe.down_proj.copy_(torch.randn(fe.down_proj.shape, generator=gen) * 0.05)
    q = QuantExperts.from_float(fe, "int8")
    for T in (1, 16):
        x = torch.randn(T, D, generator=gen)
        ex = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        w = torch.softmax(torch.randn(T, K, generator=gen), -1)
        want = experts_ref(q, x, ex, w)
        fns, errs, best = {}, {}, {}
        with torch.inference_mode():
            for name, f in candidates(q, fe).items():
                fns[name] = torch.compile(f, fullgraph=True, dynamic=False)
                errs[name] = float((fns[name](x, ex, w).float() - want).abs().max() / want.abs().max())
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(10):
                        fn(x, ex, w)
                    best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / 10 * 1e6)
        print(f"tokens={T} load={os.getloadavg()[0]:.2f} "
              + " ".join(f"{n}={t:.1f}us({t / best['kernels']:.2f})" for n, t in best.items()))  # fmt: skip
        print("# max error vs experts_ref: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
