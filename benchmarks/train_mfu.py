"""Trainer throughput and MFU on the bench config (the ~31M-param config of `model_vs_reference.py`).

Runs `flashnext.train.Trainer` (Muon + AdamW, packed micro-batches, SFT loss) on synthetic pre-tokenized
sequences of mixed lengths for `--steps` optimizer steps and prints, from the steps after `--warmup`:
tokens/s, model FLOP/s (3x the analytic forward count of each packed batch; recomputation not counted) and MFU
against the measured dense-matmul peak of the device (`log.peak_flops = "measure"`: best `1024^3` matmul rate in
the run's dtype with the current thread count), plus where a step's time goes (forward+backward vs optimizer).

    python benchmarks/train_mfu.py                     # 4096-token micro-batches, 6 steps, 2 threads
    python benchmarks/train_mfu.py --token-budget 1024 --steps 4 --ac

Last line: `tokens_per_s=<x> model_gflops_per_s=<y> mfu=<z>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_vs_reference import CONFIG  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the figures")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from flashnext.train.config import load_run_config, toml_literal
    from flashnext.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        gen = torch.Generator().manual_seed(0)
        with data.open("w") as f:
            lengths = [args.token_budget // 2, args.token_budget // 4, args.token_budget // 8, 64, 17]
            for i in range(4 * (args.steps + 1)):
                n = lengths[i % len(lengths)]
                ids = torch.randint(3, CONFIG["vocab_size"], (n,), generator=gen).tolist()
                f.write(json.dumps({"input_ids": ids}) + "\n")
        cfg = load_run_config(
            None,
            [
                f"--out_dir={json.dumps(tmp + '/run')}",
                f"--data.path={json.dumps(str(data))}",
                f"--data.token_budget={args.token_budget}",
                "--model.overrides=" + toml_literal(CONFIG),
                f"--train.steps={args.steps}",
                f"--train.activation_checkpointing={str(args.ac).lower()}",
                f"--train.compile={str(args.compile).lower()}",
                "--checkpoint.export=false",
                "--log.progress=false",
            ],
        )
        trainer = Trainer(cfg)
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(
            f"# model {n_params / 1e6:.1f}M params, token budget {args.token_budget}, {args.threads} threads, "
            f"ac={args.ac} compile={args.compile}"
        )
        history = trainer.run()
    timed = history[args.warmup :] or history
    for m in history:
        print(
            f"# step {m['step']}: {m['tokens']} tokens, loss {m['loss']:.4f}, {m['seconds']:.2f}s, "
            f"(fwd+bwd {m['seconds_fwd_bwd']:.2f}s, optimizer {m['seconds_optim']:.2f}s), "
            f"{m['tokens_per_s']:,.0f} tok/s, {m['model_flops_per_s'] / 1e9:.1f} GFLOP/s, mfu {m['mfu']:.1%}"
        )
    tok_s = sum(m["tokens"] for m in timed) / sum(m["seconds"] for m in timed)
    flops = statistics.mean(m["model_flops_per_s"] for m in timed)
    mfu = statistics.mean(m["mfu"] for m in timed)
    print(f"# peak (measured matmul) {trainer.peak_flops / 1e9:.1f} GFLOP/s; measured at {time.strftime('%H:%M')}")
    print(f"tokens_per_s={tok_s:.1f} model_gflops_per_s={flops / 1e9:.2f} mfu={mfu:.4f}")


if __name__ == "__main__":
    main()
