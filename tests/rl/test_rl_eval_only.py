"""`flashnext rl --eval-only CHECKPOINT`: the held-out reward of a training checkpoint or an exported model, mean ±
standard error over N tasks, no training; one line, and the JSON with every task's reward."""

from __future__ import annotations

import json
import re
import statistics

import pytest
from test_rl_loop import _args, _cfg, _run, _steps

from flashnext.checkpoint import training as ckpt
from flashnext.cli import main as cli_main

N = 24


def test_eval_only_scores_the_held_out_split_of_a_checkpoint_and_an_export(tmp_path, capsys):
    fields = {"train.steps": 1, "orchestrator.eval_tasks": N, "checkpoint.export": True}
    run = _steps(_run(_cfg(tmp_path, "run", **fields)))  # its last evaluation: the same N tasks, the same weights
    saved = ckpt.step_dir(tmp_path / "run" / "checkpoints", 1)
    capsys.readouterr()
    assert cli_main(["rl", *_args(tmp_path, "run", **fields), "--eval-only", str(saved), "--eval-tasks", str(N)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads((tmp_path / "run" / "eval" / f"checkpoints_{saved.name}.json").read_text())
    rewards = data["rewards"]
    assert data["tasks"] == len(rewards) == N and data["step"] == 1 and data["sampling"] == "greedy"
    assert data["reward_mean"] == pytest.approx(statistics.fmean(rewards), abs=1e-12)
    assert data["reward_stderr"] == pytest.approx(statistics.stdev(rewards) / N**0.5, abs=1e-12)
    assert 1 <= data["distinct_tasks"] <= N and set(data["metrics"]) == {"exact"}
    mean, stderr = data["reward_mean"], data["reward_stderr"]
    assert re.fullmatch(
        rf"eval-only: {re.escape(str(saved))} \(env 'reverse', held-out split\): reward {mean:.3f} ± {stderr:.3f} "
        rf"\(mean ± stderr over {N} tasks, {data['distinct_tasks']} distinct, greedy\); exact [0-9.]+ ± [0-9.]+; "
        rf"metrics in {re.escape(str(tmp_path / 'run' / 'eval' / f'checkpoints_{saved.name}'))}\.json",
        line,
    ), line
    # The run's own last evaluation scored these tasks greedily with these weights, but in another engine instance:
    # equal up to an argmax near-tie flipped by rounding, which moves at most one task's reward (<= 1) of N.
    assert abs(mean - run[1]["reward/eval_mean"]) <= 1 / N
    assert cli_main(["rl", *_args(tmp_path, "run", **fields), f"--eval-only={tmp_path / 'run' / 'final'}",
                     f"--eval-tasks={N}"]) == 0  # fmt: skip
    exported = json.loads((tmp_path / "run" / "eval" / "final.json").read_text())
    assert exported["step"] is None and abs(exported["reward_mean"] - mean) <= 1 / N  # the same weights, exported
    capsys.readouterr()
    assert cli_main(["rl", *_args(tmp_path, "run", **fields), "--env.seed=7", "--eval-only", str(saved)]) == 0
    assert capsys.readouterr().err.startswith(f"flashnext rl: warning: {saved} was trained on env {{")


def test_results_of_two_checkpoints_never_share_a_file(tmp_path):
    from flashnext.rl.evaluate import _name

    out = tmp_path / "runs" / "tiny-rl"
    assert _name(out / "checkpoints" / "step_00000120", out) == "checkpoints_step_00000120"
    assert _name(out / "final", out) == "final"
    assert _name(tmp_path / "runs" / "tiny-sft" / "final", out) == "_".join((*tmp_path.parts[1:], "runs", "tiny-sft",
                                                                             "final"))  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eval-only", "nowhere"], r"--eval-only 'nowhere' does not exist"),
        (["--eval-only", "."], r"--eval-only '\.' is neither a training checkpoint \(meta\.json\) nor an exported"),
        (["--eval-only", ".", "--eval-tasks", "1"], r"--eval-tasks 1: need at least 2 tasks"),
        (["--eval-only", ".", "--eval-tasks=many"], r"--eval-tasks needs a whole number of tasks, got 'many'"),
        (["--eval-tasks", "8"], r"--eval-tasks goes with --eval-only CHECKPOINT"),
        (["--eval-only"], r"--eval-only needs a checkpoint directory"),
    ],
)
def test_eval_only_errors_are_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["rl", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(rf"flashnext rl: error: {message}.*", err[0]), err
