"""init_distributed: single process without a launcher, and a real `torchrun` launch on gloo; the spawn helpers' failure
reports (a rank killed by a signal, a shared run that failed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dist_helpers
import pytest
from dist_helpers import RankKilled, free_port, run_spawned, spawned_once

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


def crash_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # a read of address 0: SIGSEGV, as a native crash in a collective would be
    return rank


def test_a_rank_killed_by_a_signal_is_reported_with_its_python_stack(capfd):
    with pytest.raises(RankKilled, match=r"a rank died without answering; exit codes \[.*-11\]"):
        run_spawned(crash_on_rank_one, 2, timeout_s=60)
    err = capfd.readouterr().err
    assert "Segmentation fault" in err and "crash_on_rank_one" in err, err[-2000:]


def test_a_failed_shared_run_is_reported_once_then_named_without_running_again(monkeypatch):
    calls = []

    def failing(fn, world, *args, timeout_s):
        calls.append((fn, world, args))
        raise RuntimeError("spawned ranks failed:\nrank 1: boom")

    monkeypatch.setattr(dist_helpers, "run_spawned", failing)
    cache: dict = {}
    with pytest.raises(RuntimeError, match="rank 1: boom"):
        spawned_once(cache, "k", len, 2, "a")
    with pytest.raises(RuntimeError, match=r"(?s)shared spawned run 'k' failed \(reported in full .*rank 1: boom"):
        spawned_once(cache, "k", len, 2, "a")
    assert calls == [(len, 2, ("a",))]
    monkeypatch.setattr(dist_helpers, "run_spawned", lambda fn, world, *args, timeout_s: [world, *args])
    assert spawned_once(cache, "other", len, 2, "b") == [2, "b"] == spawned_once(cache, "other", len, 2, "b")


def test_a_shared_run_whose_rank_was_killed_runs_once_more_in_its_emptied_directory(monkeypatch, tmp_path):
    outcomes = [RankKilled("a rank died without answering; exit codes [0, -11]"), ["done"]]
    seen = []

    def flaky(fn, world, *args, timeout_s):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        (tmp_path / "half-written").touch()
        got = outcomes.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(dist_helpers, "run_spawned", flaky)
    with pytest.warns(UserWarning, match=r"exit codes \[0, -11\]; emptied .* and ran it again"):
        assert spawned_once({}, "k", len, 2, fresh_dir=tmp_path) == ["done"]
    assert seen == [[], []]  # the second attempt started from an empty directory
    outcomes[:] = [RankKilled("killed"), ["never"]]
    with pytest.raises(RankKilled):  # without a directory of its own, a killed run is not run again
        spawned_once({}, "k", len, 2)
    outcomes[:] = [RuntimeError("spawned ranks failed: AssertionError"), ["never"]]
    with pytest.raises(RuntimeError, match="AssertionError"):  # nor one that failed any other way
        spawned_once({}, "k", len, 2, fresh_dir=tmp_path)
    assert outcomes == [["never"]]
