"""`flashnext.denormals`: the flush mode reaches every thread of the OpenMP team, and the trainer and `serve` set it.

The mode is per thread, so each check runs in a fresh interpreter (nothing here changes this process's mode). A
product of 2^20 denormals by 1.0 runs on both threads of a 2-thread team (ATen splits an elementwise op above 32768
elements), half each: it is all zero only when both threads flush, and half zero when only the caller does."""

import subprocess
import sys

import pytest

TEAM = """
import torch
torch.set_num_threads(2)
x = torch.full((1 << 20,), 1e-39)
def nonzero():
    return int((x * 1.0).count_nonzero())
before = nonzero()  # the team's worker thread exists from here on
"""


def run(body: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", TEAM + body], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


def test_flush_reaches_the_workers_that_already_exist():
    before, caller_only, team_set, flushed, kept_set, kept = run(
        """
torch.set_flush_denormal(True)
caller_only = nonzero()
from flashnext.denormals import flush_denormals
team = flush_denormals()
flushed = nonzero()
kept_team = flush_denormals(False)
print(before, caller_only, team, flushed, kept_team, nonzero())
"""
    )
    n = 1 << 20
    assert before == n
    assert caller_only == n // 2  # torch's own call leaves the worker's half denormal: why the module exists
    assert (team_set, flushed) == (2, 0)
    assert (kept_set, kept) == (2, n)


@pytest.mark.parametrize("flush", [True, False])
def test_trainer_threads_follow_the_config(flush):
    (zeros,) = run(
        f"""
from flashnext.train.config import load_run_config
from flashnext.train.setup import seed_threads
cfg = load_run_config(overrides=["train.threads=2", "train.flush_denormals={str(flush).lower()}"])
seed_threads(cfg)
print(nonzero())
"""
    )
    assert zeros == (0 if flush else 1 << 20)
