"""Environments: seeded tasks, disjoint train/eval splits, rewards on known answers, prompts in the SFT format,
user classes by `module:Class`, and errors naming the bad setting."""

from __future__ import annotations

import sys
import textwrap

import pytest

from flashnext.errors import ConfigError
from flashnext.rl.envs import ArithEnv, Environment, ReverseEnv, Score, load_environment
from flashnext.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_tasks_are_seeded_and_splits_disjoint():
    env = ReverseEnv(seed=3)
    train = [env.task("train", i) for i in range(200)]
    assert train == [ReverseEnv(seed=3).task("train", i) for i in range(200)]
    assert train != [ReverseEnv(seed=4).task("train", i) for i in range(200)]
    held_out = {env.key(env.task("eval", i)) for i in range(50)}
    assert not held_out & {env.key(t) for t in train}
    assert all(env.split_of(env.task("eval", i)) == "eval" for i in range(50))
    arith = ArithEnv(max_value=10)
    keys = [arith.key(arith.task(split, i)) for split in ("train", "eval") for i in range(100)]
    assert not set(keys[:100]) & set(keys[100:])
    assert all(3 <= len(t["symbols"]) <= 8 for t in train)


def test_reverse_reward_is_the_sequence_matcher_ratio(tok):
    env = ReverseEnv()
    env.setup(tok, None)
    task = {"symbols": ["cat", "sun", "map"]}
    assert tok.decode(env.prompt(task).ids) == "Q: Reverse: cat sun map\nA:"
    assert env.score(task, " map sun cat") == Score(1.0, {"exact": 1.0})
    assert env.score(task, " map sun cat\nQ: more").reward == 1.0  # only the answer line counts
    partial = env.score(task, " map cat")
    assert partial.reward == pytest.approx(2 * 7 / (7 + 11)) and partial.metrics["exact"] == 0.0
    assert env.score(task, "").reward == 0.0


def test_arith_reward_exact_number(tok):
    env = ArithEnv()
    env.setup(tok, None)
    task = {"a": 14, "b": 12, "op": "plus"}
    assert tok.decode(env.prompt(task).ids) == "Q: What is 14 plus 12?\nA:"
    assert env.score(task, " 26.").reward == 1.0
    assert env.score(task, " 27.").reward == 0.0
    assert env.score({"a": 9, "b": 4, "op": "minus"}, " 5").reward == 1.0
    assert all(t["op"] == "plus" or t["a"] >= t["b"] for t in (env.task("train", i) for i in range(100)))


def test_user_environment_by_module_and_class(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(
        textwrap.dedent("""
        from flashnext.rl.envs import Environment, Prompt, Score

        class Parity(Environment):
            name = "parity"

            def __init__(self, width=3, **kw):
                super().__init__(**kw)
                self.width = width

            def draw(self, rng):
                return {"bits": [rng.randint(0, 1) for _ in range(self.width)]}

            def prompt(self, task):
                return Prompt(self.encode("Q: " + " ".join(map(str, task["bits"])) + "\\nA:"))

            def score(self, task, completion):
                return Score(float(completion.strip() == str(sum(task["bits"]) % 2)))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("my_env:Parity", {"width": 5}, seed=1, eval_percent=20, max_tokens=2)
    assert isinstance(env, Environment) and env.width == 5 and env.max_tokens == 2
    assert len(env.task("train", 0)["bits"]) == 5
    sys.modules.pop("my_env", None)


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("nope", {}, "not a built-in environment"),
        ("no_such_module:Env", {}, "cannot import"),
        ("flashnext.rl.envs:Score", {}, "not a subclass"),
        ("reverse", {"min_len": 5, "max_len": 2}, "min_len <= max_len"),
        ("reverse", {"colour": 1}, "env.args for 'reverse'"),
        ("arith", {"ops": ["times"]}, "unknown ops"),
    ],
)
def test_bad_environment_settings_named(name, args, message):
    with pytest.raises(ConfigError, match=message):
        load_environment(name, args)


def test_color_env_needs_a_vision_tower(tok):
    from flashnext.config import tiny_config

    with pytest.raises(ConfigError, match="composite model"):
        load_environment("color").setup(tok, tiny_config())
