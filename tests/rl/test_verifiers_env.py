"""`env.name = "verifiers:NAME"`: an installed verifiers (0.4.0) taskset in flashnext's RL loop. The taskset is
`tests/rl/vf_tiny_env` (a package verifiers finds by its id `vf-tiny-env`). Without verifiers installed only the
install hint is checked (`pip install 'flashnext[verifiers]'` runs the rest)."""

from __future__ import annotations

import sys

import pytest

from flashnext.errors import ConfigError
from flashnext.rl.envs import load_environment
from flashnext.tokenizer import load_tokenizer

NAME = "verifiers:vf-tiny-env"


@pytest.fixture(scope="module")
def vf():
    return pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed")


@pytest.fixture
def env(vf):
    env = load_environment(NAME, {"num_tasks": 40}, seed=3, eval_percent=25, max_tokens=4)
    env.setup(load_tokenizer(), None)
    return env


def test_without_verifiers_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # what `import verifiers` meets when it is not installed
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ConfigError, match=r"pip install 'flashnext\[verifiers\]'") as e:
        load_environment(NAME, {})
    assert "\n" not in str(e.value) and "verifiers:vf-tiny-env" in str(e.value)


def test_tasks_splits_and_prompt(env):
    assert len(env.tasks) == 40
    train = {env.task("train", i)["index"] for i in range(200)}
    held_out = {env.task("eval", i)["index"] for i in range(200)}
    assert train and held_out and not train & held_out and len(train | held_out) == 40  # disjoint, every task
    # epochs: the first len(split) indices are the split, each once
    n_eval = len(held_out)
    assert sorted(env.task("eval", i)["index"] for i in range(n_eval)) == sorted(held_out)
    assert env.task("train", 7) == env.task("train", 7)
    task = env.task("train", 0)
    answer = env.tasks[task["index"]].data.answer
    turns = [("system", "Reasoning effort: xhigh.\n\nOne word."), ("user", f"Say {answer}.")]
    want = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
    want += "<|im_start|>assistant\n<think>\n"
    assert env.prompt(task).ids == env.tokenizer.encode(want)


def test_rewards_are_verifiers_weighted_sum(env):
    task = env.task("train", 0)
    answer = env.tasks[task["index"]].data.answer
    reply = f" {answer}."  # verifiers' last_reply strips it
    exact = env.score(task, reply)
    short = 1 - len(reply.strip()) / 40
    assert exact.metrics == {"exact": 1.0, "mentions": 1.0, "short": short, "reply_chars": len(reply.strip())}
    assert exact.reward == pytest.approx(0.5 + 0.25 + 0.25 * short, abs=1e-12)  # float sums: not bitwise
    mention = env.score(task, f"it is {answer}")
    assert mention.metrics["exact"] == 0.0 and mention.metrics["mentions"] == 1.0
    assert mention.reward == pytest.approx(0.25 + 0.25 * mention.metrics["short"], abs=1e-12)
    assert env.score(task, "x" * 50).reward == 0.0


def test_taskset_errors_are_one_line(vf):
    with pytest.raises(ConfigError, match=r"num_tasks: Input should be a valid integer") as e:
        load_environment(NAME, {"num_tasks": "many"})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"verifiers:no-such-taskset.*not found"):
        load_environment("verifiers:no-such-taskset", {})


def test_multi_turn_tasksets_are_refused(vf, monkeypatch):
    import vf_tiny_env

    class ToolTask(vf_tiny_env.SayTask):
        @classmethod
        def toolsets(cls, config):
            return ["a toolset"]

    class ToolTaskset(vf_tiny_env.SayTaskset):
        def load(self):
            return [ToolTask(t.data, t.config) for t in super().load()]

    monkeypatch.setattr(vf_tiny_env, "SayTaskset", ToolTaskset)
    with pytest.raises(ConfigError, match="single-turn.*tools.*multi-turn is not supported"):
        load_environment(NAME, {})


def test_rl_steps_on_a_verifiers_taskset(vf, tmp_path):
    """A few RL steps of the tiny model on the taskset; its rewards reach the metrics."""
    import torch
    from test_rl_loop import _cfg

    from flashnext.rl.loop import RLTrainer

    cfg = _cfg(tmp_path, **{"env.name": NAME, "env.args": {"num_tasks": 40}, "env.eval_percent": 25,
                            "train.steps": 2, "optim.total_steps": 2, "inference.max_model_len": 96})  # fmt: skip
    torch.set_num_threads(2)
    history = RLTrainer(cfg, say=lambda *a: None).run()
    steps = {int(m["step"]): m for m in history}
    assert sorted(steps) == [0, 1, 2]
    for step in (1, 2):
        m = steps[step]
        assert m["rollout/samples"] == 8 and 0 <= m["reward/mean"] <= 1
        assert {"reward/exact", "reward/mentions", "reward/short", "reward/reply_chars"} <= m.keys()
        assert m["rl/mismatch_kl"] <= 1e-6
    assert "reward/eval_mean" in steps[0] and "reward/eval_exact" in steps[2]


@pytest.mark.parametrize("argv", [["--env", NAME], [f"--env={NAME}"]], ids=["space", "equals"])
def test_rl_cli_env_flag(argv):
    from flashnext.cli.rl import parse_args

    cfg, _ = parse_args([*argv, "--env.args={num_tasks = 9}"])
    assert cfg.env.name == NAME and cfg.env.args == {"num_tasks": 9}
