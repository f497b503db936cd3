"""The tiny RL recipe end to end, as on a fresh box: `flashnext rl --config configs/tiny-rl.toml` in an empty work
directory (so the warm-start SFT run is trained first), timed, then its held-out reward and mismatch KL read back.

    python benchmarks/rl_tiny.py                       # a fresh temporary work directory (SFT + RL)
    python benchmarks/rl_tiny.py --workdir DIR         # reuse DIR (an SFT run already there is not repeated)
    python benchmarks/rl_tiny.py -- --train.steps=10   # extra arguments go to flashnext rl

Prints the wall time, the CPU time of the run (user + system, all threads) and the load average before and after
(the box may be shared: wall time is only comparable at low load), the eval reward at each evaluation, and as its
last line `reward_start=<x> reward_end=<y> mismatch_kl_max=<z> rollout_tok_s=<a> train_tok_s=<b>`: held-out reward
(greedy) before the first and after the last step, the largest per-step mismatch KL, and the mean rollout and
training tokens/s over the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help="run there (default: a fresh temporary directory)")
    p.add_argument("--config", default="configs/tiny-rl.toml", help="RL run config, relative to the repository")
    p.add_argument("extra", nargs="*", help="more flashnext rl arguments (after --)")
    args = p.parse_args()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rl_tiny_"))
    shutil.copytree(ROOT / "configs", work / "configs", dirs_exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "flashnext", "rl", "--config", args.config, "--overwrite", "--log.progress=false",
           *args.extra]  # fmt: skip
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, text=True)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"flashnext rl failed with status {proc.returncode}")
    out_dir = _out_dir(work, args.config, args.extra)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["reward/eval_mean"]) for r in rows if "reward/eval_mean" in r]
    steps = [r for r in rows if "loss" in r]
    print(f"work dir {work}; wall {wall:.1f}s, cpu {usage.ru_utime + usage.ru_stime:.1f}s; load average "
          f"{load0[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1-minute)")  # fmt: skip
    print("eval reward by step: " + ", ".join(f"{s}: {r:.3f}" for s, r in evals))
    kl = max(r["rl/mismatch_kl"] for r in steps)
    rollout = sum(r["rollout/tokens_per_s"] for r in steps) / len(steps)
    train = sum(r["tokens_per_s"] for r in steps) / len(steps)
    print(f"reward_start={evals[0][1]:.4f} reward_end={evals[-1][1]:.4f} mismatch_kl_max={kl:.3e} "
          f"rollout_tok_s={rollout:.1f} train_tok_s={train:.1f}")  # fmt: skip


def _out_dir(work: Path, config: str, extra: list[str]) -> Path:
    out = next((a.split("=", 1)[1].strip('"') for a in extra if a.startswith("--out_dir=")), None)
    if out is None:
        import tomllib

        out = tomllib.loads((work / config).read_text()).get("out_dir", "runs/tiny-rl")
    return work / out


if __name__ == "__main__":
    main()
