"""Load peak memory of int8 / int4 serving: an int checkpoint on disk (`flashnext quantize --weights int8|int4`)
against the bf16 checkpoint loaded and quantized in memory (`serve --weights int8` on the float checkpoint).

Configs of `benchmarks/quantized.py`: `31m` (~31M params, 16 experts) and `64e` (64 experts: the experts dominate).
Random weights (`build_model`, seed 0) saved in bf16, then quantized on disk once. Each (config, scheme, route) loads
in its own process (`--worker`) with `dtype=bfloat16`, 1 thread; peak_mb = the process's peak RSS
(`resource.getrusage` ru_maxrss, reset after the imports through `/proc/self/clear_refs`) minus its RSS then: it
counts file-backed pages too (the mmapped checkpoint, torch's library code first touched). peak_anon_mb = the peak
of the anonymous (heap) RSS, sampled every millisecond by a thread (`RssAnon`), less its value after the imports:
the tensors the load allocates, without the file pages. held_mb = RSS after the load (`malloc_trim`) less the base.

Output, per config and scheme, then one line:
    config=<c> weights=<s> route=<disk|memory> peak_mb=<x> peak_anon_mb=<x> held_mb=<x> load=<1-min load>
    load_peak_int8_disk_vs_memory=<ratio> load_peak_anon_int8_disk_vs_memory=<ratio> ... (the last config's)

    python benchmarks/int_checkpoint_load.py [--configs 31m 64e]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def worker(args) -> None:
    from quantized import rss_bytes

    import flashnext
    from flashnext.quant.apply import QuantScheme, quantize_model

    torch.set_num_threads(1)
    base, anon0 = rss_bytes(), _anon()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM, ru_maxrss) to now: not the imports'
    peak_anon, done = [anon0], threading.Event()

    def sample() -> None:  # the anonymous (heap) RSS every millisecond: the mmapped checkpoint pages excluded
        while not done.wait(0.001):
            peak_anon[0] = max(peak_anon[0], _anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if args.route == "disk":
        model = flashnext.from_pretrained(args.path, dtype=torch.bfloat16)
    else:
        model = quantize_model(flashnext.from_pretrained(args.path, dtype=torch.bfloat16),
                               QuantScheme.from_flags(args.weights))  # fmt: skip
    done.set()
    sampler.join()
    held = rss_bytes() - base
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    assert model.model.layers[0].mlp.experts.scheme == args.weights
    print(json.dumps({"peak_mb": peak / 2**20, "held_mb": held / 2**20, "anon_mb": (peak_anon[0] - anon0) / 2**20}))


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["31m", "64e"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--route", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from quantized import config

    from flashnext.build import build_model
    from flashnext.checkpoint import save_pretrained
    from flashnext.config import parse_config
    from flashnext.quant.apply import QuantScheme
    from flashnext.quant.int_quantize import quantize_int

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            root = Path(tmp) / name
            save_pretrained(build_model(parse_config(config(name)), seed=0, dtype=torch.bfloat16), root / "bf16")
            for weights in ("int8", "int4"):
                quantize_int(root / "bf16", root / weights, QuantScheme.from_flags(weights))
                got = {}
                for route, path in (("memory", root / "bf16"), ("disk", root / weights)):
                    cmd = [sys.executable, __file__, "--worker", "--path", str(path), "--weights", weights,
                           "--route", route]  # fmt: skip
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                    got[route] = json.loads(out.strip().splitlines()[-1])
                    g = got[route]
                    print(f"config={name} weights={weights} route={route} peak_mb={g['peak_mb']:.1f} "
                          f"peak_anon_mb={g['anon_mb']:.1f} held_mb={g['held_mb']:.1f} "
                          f"load={os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
                ratios[f"peak_{weights}"] = got["disk"]["peak_mb"] / got["memory"]["peak_mb"]
                ratios[f"peak_anon_{weights}"] = got["disk"]["anon_mb"] / got["memory"]["anon_mb"]
    print(" ".join(f"load_{k}_disk_vs_memory={r:.2f}" for k, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
