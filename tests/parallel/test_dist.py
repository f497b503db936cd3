"""init_distributed: single process without a launcher, and a real `torchrun` launch on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import free_port

from flashnext.parallel import init_distributed


def test_without_launcher_is_single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    ctx = init_distributed(device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.mesh, ctx.backend, ctx.is_main, ctx.distributed) == (
        0, 1, None, None, True, False
    )  # fmt: skip


@pytest.mark.slow
def test_torchrun_two_processes_on_gloo():
    probe = Path(__file__).with_name("torchrun_probe.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(probe)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                     key=lambda r: r["rank"])  # fmt: skip
    assert [(r["rank"], r["world"], r["main"], r["backend"], r["mesh"], r["sum"]) for r in reports] == [
        (0, 2, True, "gloo", 2, 3.0),
        (1, 2, False, "gloo", 2, 3.0),
    ]
