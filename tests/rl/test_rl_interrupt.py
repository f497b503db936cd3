"""An RL run that stops keeps its work: Ctrl-C (SIGINT, from outside, in a subprocess) and SIGTERM finish the step in
flight, save a checkpoint and exit 130 / 143 with a line saying where; an exception inside the loop (an
environment's `score` raising at step 3) saves step 2 first; `--resume` from either continues to the uninterrupted
run's numbers; `--debug` shows the environment's own traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_rl_loop import _args, _assert_same, _cfg, _run, _steps

from flashnext.checkpoint import training as ckpt
from flashnext.cli import main as cli_main
from flashnext.rl.envs import EnvError, ReverseEnv

ROOT = Path(__file__).parents[2]
CALLS_PER_STEP = 2 * 4  # batch_size x group_size of `_cfg`: `score` calls of one step (eval_tasks=0 below)


class FailAt(ReverseEnv):
    """`reverse`, but the `fail_at`-th call of `score` in this process raises (0: never)."""

    calls = 0

    def __init__(self, fail_at: int = 0, **kw):
        super().__init__(**kw)
        self.fail_at = fail_at

    def score(self, task, completion):
        FailAt.calls += 1
        if FailAt.calls == self.fail_at:
            raise ValueError(f"judge unreachable (call {FailAt.calls})")
        return super().score(task, completion)


class SignalAt(ReverseEnv):
    """`reverse`, but the `at`-th call of `score` sends this process `signum` (as a Ctrl-C from outside would)."""

    calls = 0

    def __init__(self, at: int = 0, signum: int = 15, **kw):
        super().__init__(**kw)
        self.at, self.signum = at, signum

    def score(self, task, completion):
        SignalAt.calls += 1
        if SignalAt.calls == self.at:
            os.kill(os.getpid(), self.signum)
        return super().score(task, completion)


def _env(cls, **args) -> dict:
    return {"env.name": f"{__name__}:{cls.__name__}", "env.args": args, "orchestrator.eval_tasks": 0}


def test_exception_in_the_loop_saves_the_last_completed_step_and_resume_continues(tmp_path):
    FailAt.calls = 0
    fields = {"train.steps": 4, "checkpoint.every": 0}
    with pytest.raises(EnvError, match=r"task train/4: score\(\) raised ValueError: judge unreachable") as info:
        _run(_cfg(tmp_path, "crash", **fields, **_env(FailAt, fail_at=2 * CALLS_PER_STEP + 1)))  # step 3's 1st
    saved = ckpt.step_dir(tmp_path / "crash" / "checkpoints", 2)
    assert info.value.__notes__ == [
        f"saved the checkpoint of step 2 (the last completed) to {saved}; to continue, run the same command with "
        "--resume (without --overwrite)"
    ]
    assert ckpt.list_checkpoints(tmp_path / "crash" / "checkpoints") == [saved]
    resumed = _steps(_run(_cfg(tmp_path, "crash", **fields, **_env(FailAt), **{"checkpoint.resume": "latest"})))
    full = _steps(_run(_cfg(tmp_path, "full", **fields, **_env(FailAt))))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        _assert_same(resumed[step], full[step])


def test_environment_error_is_one_line_and_debug_shows_its_traceback(tmp_path, capsys):
    FailAt.calls = 0
    args = ["rl", *_args(tmp_path, "run", **_env(FailAt, fail_at=1))]
    assert cli_main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"flashnext rl: error: environment '{FailAt.name}' task train/0: score() raised ValueError: judge unreachable "
        "(call 1); no step completed since step 0: nothing new to save"
    ]
    FailAt.calls = 0
    assert cli_main([*args, "--overwrite", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and 'raise ValueError(f"judge unreachable' in err  # the environment's own frame
    assert err.strip().splitlines()[-1].startswith("flashnext rl: error: environment 'reverse' task train/0")


def test_sigterm_finishes_the_step_saves_and_exits_143(tmp_path, capsys):
    SignalAt.calls = 0
    args = _args(tmp_path, "run", **{"train.steps": 4}, **_env(SignalAt, at=CALLS_PER_STEP + 1))  # during step 2

    def unhandled(signum, frame):  # a run that does not take the signal fails this test, not the pytest process
        raise RuntimeError("SIGTERM reached the test's handler: the run did not handle it")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert cli_main(["rl", *args]) == 143
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the run's handler is gone with the run
    finally:
        signal.signal(signal.SIGTERM, before)
    saved = ckpt.step_dir(tmp_path / "run" / "checkpoints", 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"flashnext rl: stopped by SIGTERM after step 2: checkpoint {saved}; to continue, run the same "
                       "command with --resume (without --overwrite)")  # fmt: skip
    assert err[0].startswith("SIGTERM: finishing this step, then saving a checkpoint")
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == [saved]


_PAUSE_ENV = '''
import os, time
from flashnext.rl.envs import ReverseEnv

class PauseAt(ReverseEnv):
    """`reverse`; the `at`-th `score` call writes `paused` and waits for `go` (so a signal lands mid-step)."""

    calls = 0

    def __init__(self, at=0, **kw):
        super().__init__(**kw)
        self.at = at

    def score(self, task, completion):
        PauseAt.calls += 1
        if PauseAt.calls == self.at:
            open("paused", "w").close()
            for _ in range(1200):
                if os.path.exists("go"):
                    break
                time.sleep(0.05)
        return super().score(task, completion)
'''


def test_ctrl_c_in_a_subprocess_saves_and_resume_matches_the_uninterrupted_run(tmp_path, monkeypatch):
    """SIGINT from outside while step 3 is in flight: the step finishes, step_3 is saved, exit 130; the resumed run's
    step 4 equals the uninterrupted run's."""
    (tmp_path / "pause_env.py").write_text(_PAUSE_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    fields = {"train.steps": 4, "train.threads": 1, "env.name": "pause_env:PauseAt", "orchestrator.eval_tasks": 0}
    args = _args(tmp_path, "run", **fields, **{"env.args": {"at": 2 * CALLS_PER_STEP + 1}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)])}
    cmd = [sys.executable, "-m", "flashnext", "rl", *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "paused").exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # let the handler run while the step is still paused
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    saved = ckpt.step_dir(tmp_path / "run" / "checkpoints", 3)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"flashnext rl: stopped by SIGINT after step 3: checkpoint {saved}; to continue, run the same command with "
        "--resume (without --overwrite)"
    )
    assert "Traceback" not in err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert ckpt.load_meta(saved)["step"] == 3

    resumed = _steps(_run(_cfg(tmp_path, "run", **fields, **{"checkpoint.resume": "latest"})))
    full = _steps(_run(_cfg(tmp_path, "full", **fields)))
    assert sorted(resumed) == [4]
    _assert_same(resumed[4], full[4])
    _assert_same(_steps(rows)[3], full[3])  # the interrupted run's own steps were the uninterrupted run's
