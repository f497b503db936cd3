"""The SFT recipe's step time on an idle box and beside busy processes, per thread setting.

    python benchmarks/threads_under_load.py                      # 30 steps of configs/tiny-sft.toml, 2 busy processes
    python benchmarks/threads_under_load.py --busy 3 --steps 40
    python benchmarks/threads_under_load.py --settings default,threads=2,threads=2+passive

A "busy process" is another job on the box: a single-threaded fp32 matmul loop that runs until the measurement ends.
Each setting runs `flashnext train --config configs/tiny-sft.toml --train.steps=N` twice, idle and loaded, and the
median of `seconds` per step in metrics.jsonl (the first 3 steps dropped: warm-up) is compared. Settings:
`default` (what the recipe ships), `threads=T` (`--train.threads=T`), a `+passive` suffix sets
`OMP_WAIT_POLICY=PASSIVE` (idle OpenMP threads sleep instead of spinning), `+active` sets it to ACTIVE (spin, libgomp's
default before flashnext chose passive), `+spin=N` spins N rounds before sleeping (libgomp's `GOMP_SPINCOUNT`).
Prints a line per setting, `setting=<s> idle_s=<x> loaded_s=<y> loaded_over_idle=<r>`, and the load average seen.
Wall times are only comparable within one run of this script (the box may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BUSY = "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True:\n    a = (a @ a).tanh()\n"


def run_recipe(setting: str, steps: int, out: Path) -> float:
    """Median seconds per step of the SFT recipe under `setting` (see the module docstring)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_WAIT_POLICY", None), env.pop("GOMP_SPINCOUNT", None)
    args = [f"--train.steps={steps}", "--train.eval_every=0", "--checkpoint.every=0", "--log.progress=false"]
    for part in setting.split("+"):
        if part.startswith("threads="):
            args.append(f"--train.{part}")
        elif part in ("passive", "active"):
            env["OMP_WAIT_POLICY"] = part.upper()
        elif part.startswith("spin="):
            env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"] = "ACTIVE", part.removeprefix("spin=")
        elif part != "default":
            choices = "default, threads=T, +passive, +active, +spin=N"
            raise SystemExit(f"unknown setting part {part!r} in {setting!r}: use {choices}")
    cmd = [sys.executable, "-m", "flashnext", "train", "--config", str(ROOT / "configs/tiny-sft.toml")]
    cmd += [f"--out_dir={out}", "--overwrite", *args]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in rows if "seconds" in r][3:]
    return statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the loaded run (default 2)")
    p.add_argument("--settings", default="default,threads=2,threads=2+passive,threads=1+passive")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="threads_load_"))
    print(f"cores={os.cpu_count()} steps={args.steps} busy={args.busy} load_before={os.getloadavg()[0]:.2f}")
    for setting in args.settings.split(","):
        idle = run_recipe(setting, args.steps, work / "idle")
        busy = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(args.busy)]
        try:
            time.sleep(2.0)  # let the busy jobs start spinning
            loaded = run_recipe(setting, args.steps, work / "loaded")
            load = os.getloadavg()[0]
        finally:
            for b in busy:
                b.kill()
                b.wait()
        print(
            f"setting={setting} idle_s={idle:.3f} loaded_s={loaded:.3f} loaded_over_idle={loaded / idle:.2f}"
            f" load={load:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
