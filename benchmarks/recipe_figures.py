"""The README's recipe figures over several seeds, with their spread: the SFT recipe, then the RL recipe on each.

    python benchmarks/recipe_figures.py                    # seeds 0,1,2 in a fresh temporary directory (~20 min)
    python benchmarks/recipe_figures.py --seeds 0 --skip-rl

Seed s trains `configs/tiny-sft.toml` with `--model.seed=s --data.seed=s` (initial weights and data order), then
`configs/tiny-rl.toml` from that run's export with `--orchestrator.seed=s` (sampling; the task split stays the
recipe's, so every seed is evaluated on the same held-out tasks). Prints one line per run and, last, each figure as
`name=min..max mean=<m>` over the seeds: SFT loss at the first and last step, held-out loss, wall seconds; RL held-out
reward before the first step, after the last, at its best evaluation, the largest mismatch KL, wall seconds. Wall
times depend on the box (the load average is printed); the other figures do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], work: Path) -> float:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "flashnext", *cmd], cwd=work, env=env, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"flashnext {' '.join(cmd)} failed with status {proc.returncode}")
    return time.perf_counter() - t0


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def sft(seed: int, work: Path) -> dict[str, float]:
    out = f"runs/sft-{seed}"
    wall = _run(["train", "--config", "configs/tiny-sft.toml", f"--out_dir={out}", "--overwrite",
                 f"--model.seed={seed}", f"--data.seed={seed}", "--log.progress=false"], work)  # fmt: skip
    rows = _rows(work / out)
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return {"sft_loss_first": losses[0], "sft_loss_last": losses[-1], "sft_eval_loss": evals[-1], "sft_wall_s": wall}


def rl(seed: int, work: Path) -> dict[str, float]:
    out = f"runs/rl-{seed}"
    wall = _run(["rl", "--config", "configs/tiny-rl.toml", f"--out_dir={out}", "--overwrite",
                 f"--model.path=runs/sft-{seed}/final", f"--orchestrator.seed={seed}", "--log.progress=false"],
                work)  # fmt: skip
    rows = _rows(work / out)
    rewards = [r["reward/eval_mean"] for r in rows if "reward/eval_mean" in r]
    kl = max(r["rl/mismatch_kl"] for r in rows if "rl/mismatch_kl" in r)
    return {"rl_reward_start": rewards[0], "rl_reward_end": rewards[-1], "rl_reward_best": max(rewards),
            "rl_mismatch_kl_max": kl, "rl_wall_s": wall}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--workdir", default=None, help="run there (default: a fresh temporary directory)")
    p.add_argument("--skip-rl", action="store_true", help="the SFT recipe only")
    args = p.parse_args()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="recipe_figures_"))
    shutil.copytree(ROOT / "configs", work / "configs", dirs_exist_ok=True)
    print(f"work dir {work}; cores={os.cpu_count()} load_before={os.getloadavg()[0]:.2f}", flush=True)
    figures: dict[str, list[float]] = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        got = sft(seed, work)
        if not args.skip_rl:
            got |= rl(seed, work)
        print(f"seed={seed} " + " ".join(f"{k}={v:.4g}" for k, v in got.items()), flush=True)
        for k, v in got.items():
            figures.setdefault(k, []).append(v)
    print(f"load_after={os.getloadavg()[0]:.2f}")
    print(" ".join(f"{k}={min(v):.4g}..{max(v):.4g} mean={statistics.fmean(v):.4g}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
