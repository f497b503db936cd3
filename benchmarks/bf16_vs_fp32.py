"""Our bf16 training step against our own fp32 one: fwd+bwd tokens/s, ratio, MFU of each, per-op shares.

The bench config of `model_vs_reference.py` (~31M parameters; the same checkpoint loaded twice, in float32 and
in bfloat16), the trainer's loss-only forward (`return_logits=False`), 2 threads. The two models alternate run by
run, so other load on the machine falls on both alike; each figure is the median of `--repeats` runs after one
untimed run. MFU as in `model_vs_reference.py`: 3x the analytic forward FLOPs of `flashnext.flops` per second,
against the GEMM peak of each dtype measured in the same run (`train.metrics.measure_peak_flops`, 2048^3).
Unlike `model_vs_reference.py` it does not run the transformers reference (minutes per fwd+bwd at 4096 tokens),
so it answers the issue-31 question alone: does bf16 pay (aim: bf16 >= 1.5x our fp32, MFU >= 0.3)?

`--profile N` adds one torch.profiler run per dtype and prints the top N ops by self CPU time, as shares of that
run's total, both dtypes side by side: on a loaded box the shares are steadier evidence than the times. Then the
GEMMs' share of each and the MFU bound it sets: the MFU the step would reach if every other op took no time.

`--compile` runs both models through `flashnext.compile.compile_model` (what `train.compile=true` does: each
decoder layer compiled, the opaque ops eager between graphs); the untimed first run compiles (minutes).

    python benchmarks/bf16_vs_fp32.py                       # 4096 tokens, 3 repeats
    python benchmarks/bf16_vs_fp32.py --seqs 1024 4096 --profile 15

Output per sequence length n: `seq=<n> fp32=<tok/s> bf16=<tok/s> ratio=<bf16/fp32> mfu_fp32=<x> mfu_bf16=<y>`,
last line `bf16_ratio_<n>=<x> ... mfu_bf16_<n>=<y> ...`. Lines starting with `#` are context.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_vs_reference import (  # noqa: E402
    CONFIG,
    add_denormals_arg,
    forward_backward_fn,
    load_average,
    load_harness,
    median_seconds,
    op_self_times,
    set_denormals,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm")  # the products' self time


def op_shares(fn) -> dict[str, float]:
    """One run of `fn` under torch.profiler: every op's share of the run's self CPU time."""
    times = op_self_times(fn)
    total = sum(times.values())
    return {key: t / total for key, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096], help="sequence lengths (default 4096)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per dtype (default 3, at least 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    add_denormals_arg(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    parser.add_argument("--profile", type=int, default=0, help="print the top-N ops of each dtype side by side")
    parser.add_argument(
        "--compile", action="store_true", help="both models through `compile_model` (train.compile=true's layers)"
    )
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats must be >= 3 (a median of at least 3), got {args.repeats}")

    import flashnext
    from flashnext.config import TextConfig
    from flashnext.flops import count_flops
    from flashnext.train.metrics import measure_peak_flops

    torch.set_num_threads(args.threads)
    set_denormals(args)
    print(f"# load average (1/5/15 min) at start: {load_average()}")
    reference = load_harness().build_reference(dict(CONFIG), seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="flashnext-bench-") as tmp:
        reference.save_pretrained(tmp)
        del reference
        models = {name: flashnext.from_pretrained(tmp, dtype=dt, device="cpu").eval() for name, dt in DTYPES.items()}
    if args.compile:
        from flashnext.compile import compile_model

        for model in models.values():
            compile_model(model)
        print("# compile_model: every decoder layer and the final mixer compiled (the untimed run compiles)")
    peak = {name: measure_peak_flops(torch.device("cpu"), dt, n=2048) for name, dt in DTYPES.items()}
    print("# measured GEMM peak (2048^3): " + " ".join(f"{n}={p / 1e9:.1f} GFLOP/s" for n, p in peak.items()))
    text_cfg = TextConfig.from_dict(dict(CONFIG))
    gen = torch.Generator().manual_seed(args.seed)
    summary = {}
    for seq in args.seqs:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=gen)
        fns = {name: forward_backward_fn(m, ids, loss_only=True) for name, m in models.items()}
        t, _ = median_seconds(fns, args.repeats, warmup=1)
        flops = 3 * count_flops(text_cfg, [seq])["total"]
        mfu = {name: flops / t[name] / peak[name] for name in fns}
        ratio = t["fp32"] / t["bf16"]
        summary[seq] = (ratio, mfu["bf16"])
        print(
            f"seq={seq} fp32={seq / t['fp32']:.1f} bf16={seq / t['bf16']:.1f} ratio={ratio:.2f} "
            f"mfu_fp32={mfu['fp32']:.3f} mfu_bf16={mfu['bf16']:.3f}  # load {load_average()}",
            flush=True,
        )
        if args.profile:
            shares = {name: op_shares(fn) for name, fn in fns.items()}
            top = sorted(
                set(shares["fp32"]) | set(shares["bf16"]), key=lambda k: -max(s.get(k, 0) for s in shares.values())
            )
            print(f"# seq={seq} self CPU share per op:  fp32   bf16")
            for key in top[: args.profile]:
                print(f"#   {key:32s} {shares['fp32'].get(key, 0):.3f}  {shares['bf16'].get(key, 0):.3f}")
            gemm = {name: sum(s.get(k, 0.0) for k in GEMM_OPS) for name, s in shares.items()}
            print(
                f"# seq={seq} GEMM share (mm, bmm, addmm, baddbmm) fp32={gemm['fp32']:.3f} bf16={gemm['bf16']:.3f}; "
                "MFU with every other op free: " + " ".join(f"{n}={mfu[n] / max(gemm[n], 1e-9):.3f}" for n in fns)
            )
    print(f"# load average (1/5/15 min) at end: {load_average()}")
    print(
        " ".join(f"bf16_ratio_{seq}={r:.2f}" for seq, (r, _) in summary.items())
        + " "
        + " ".join(f"mfu_bf16_{seq}={m:.3f}" for seq, (_, m) in summary.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
