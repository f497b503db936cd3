"""An environment that fails fails loudly: every error of `draw`, `prompt` or `score` is one line naming the
environment, the task and the exception; rewards are checked (a `Score` of a real number, finite, in the declared
range); NaN rewards stop the run, or with `nan_rewards="skip"` are left out and counted, never dropped silently."""

from __future__ import annotations

import math

import pytest
import torch

from flashnext.errors import InputError
from flashnext.rl.envs import EnvError, Environment, Prompt, Score, make_prompt, score_completion
from flashnext.rl.inference import Choice, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator
from flashnext.rl.rollouts import Sample, assign_advantages


class _Ids:
    """Decodes a completion's ids as `"7,8"` (the env reads its answer from that)."""

    def decode(self, ids):
        return ",".join(map(str, ids))

    def encode(self, text):
        return [ord(c) % 50 for c in text]


class Scripted(Environment):
    """Task i of a split is `{"i": <draw count>}`; `score` looks the completion up in `rewards` (a value that is an
    exception type is raised); `fail` names a method that raises ValueError."""

    name = "scripted"

    def __init__(self, rewards=None, fail=None, reward_range=None, **kw):
        super().__init__(**kw)
        self.rewards, self.fail = rewards or {}, fail
        if reward_range is not None:
            self.reward_range = reward_range
        self.tokenizer, self.draws = _Ids(), 0

    def split_of(self, task):
        return "eval" if task["i"] % 2 else "train"

    def draw(self, rng):
        if self.fail == "draw":
            raise ValueError("no dice")
        self.draws += 1
        return {"i": self.draws}

    def prompt(self, task):
        if self.fail == "prompt":
            raise KeyError("symbols")
        return "not a prompt" if self.fail == "prompt-type" else Prompt([1, 2, 3])

    def score(self, task, completion):
        if self.fail == "score":
            raise ValueError("cannot parse\n  the answer")
        value = self.rewards.get(completion, 0.0)
        return value if isinstance(value, str) else Score(value)


class FakeClient:
    """Returns, per request, the completions `[[7], [8], [9], [10]][:n]` (one token each)."""

    def generate(self, reqs, spec):
        return [[Choice([7 + j], [-0.5], "stop") for j in range(r.n)] for r in reqs]


def _orch(env, **kw):
    return Orchestrator(env, FakeClient(), SamplingSpec(4, 1.0, [0], False), batch_size=2, group_size=4,
                        eval_tasks=3, **kw)  # fmt: skip


def test_score_refuses_non_numbers_and_keeps_floats():
    with pytest.raises(TypeError, match=r"Score\.reward must be a real number, got str '0\.5'"):
        Score("0.5")
    with pytest.raises(TypeError, match=r"Score\.reward must be a real number, got NoneType None"):
        Score(None)
    with pytest.raises(TypeError, match=r"Score\.metrics\['exact'\] must be a real number, got str 'yes'"):
        Score(1.0, {"exact": "yes"})
    with pytest.raises(TypeError, match=r"Score\.reward must be a real number, got Tensor"):
        Score(torch.tensor([0.5, 0.5]))
    # a bool is a pass/fail reward (documented); a 0-d tensor and an int are numbers; all stored as float
    for value, want in ((True, 1.0), (False, 0.0), (torch.tensor(0.25), 0.25), (1, 1.0)):
        score = Score(value, {"m": value})
        assert type(score.reward) is float and score.reward == want and score.metrics == {"m": want}
    assert math.isnan(Score(float("nan")).reward)  # kept: "could not score" (see score_completion)


@pytest.mark.parametrize(
    ("fail", "rewards", "message"),
    [
        ("score", {}, r"^environment 'scripted' task train/2: score\(\) raised ValueError: cannot parse the answer$"),
        ("prompt", {}, r"^environment 'scripted' task train/2: prompt\(\) raised KeyError: 'symbols'$"),
        ("prompt-type", {}, r"^environment 'scripted' task train/2: prompt\(\) returned str, not a Prompt$"),
        (None, {"8": "0.5"}, r"^environment 'scripted' task train/2: score\(\) returned str '0\.5', not a Score$"),
        (None, {"8": 0.5}, None),  # a plain Score is fine (the control case)
        (None, {"8": 1.5}, r"task train/2: score\(\) returned reward 1\.5, outside .* reward_range \[0\.0, 1\.0\]$"),
        (None, {"8": float("inf")}, r"task train/2: score\(\) returned an infinite reward inf"),
        (None, {"8": float("nan")}, r"task train/2: score\(\) returned a NaN reward \(orchestrator\.nan_rewards="),
    ],
)
def test_environment_errors_name_the_environment_task_and_cause(fail, rewards, message):
    env = Scripted(rewards, fail)
    if message is None:
        assert _orch(env).rollouts(step=1, policy_step=0).stats["rollout/samples"] == 8
        return
    with pytest.raises(EnvError, match=message) as info:
        _orch(env).rollouts(step=2, policy_step=1)  # step 2: train tasks 2 and 3; task 2's completion "8" is bad
    assert "\n" not in str(info.value)
    if fail in ("score", "prompt"):
        assert isinstance(info.value.__cause__, (ValueError, KeyError))  # the env's own traceback, for --debug


def test_draw_errors_and_the_eval_split_name_the_task():
    with pytest.raises(EnvError, match=r"^environment 'scripted' task eval/4: draw\(\) raised ValueError: no dice$"):
        Scripted(fail="draw").task("eval", 4)
    with pytest.raises(EnvError, match=r"^environment 'scripted' task train/6: draw\(\) raised ValueError: no dice$"):
        _orch(Scripted(fail="draw")).rollouts(step=4, policy_step=3)

    class Rows(Scripted):  # a dataset-backed environment overrides `task` itself
        def task(self, split, index):
            return [{"i": 0}][index]

    with pytest.raises(EnvError, match=r"^environment 'scripted' task eval/1: task\(\) raised IndexError: list index"):
        _orch(Rows()).evaluate()
    with pytest.raises(EnvError, match=r"^environment 'scripted' task eval/0: score\(\) raised ValueError"):
        _orch(Scripted(fail="score")).evaluate()
    with pytest.raises(EnvError, match=r"^environment 'scripted' task eval/0: score\(\) returned a NaN reward"):
        _orch(Scripted({"7": float("nan")})).evaluate()
    assert isinstance(make_prompt(Scripted(), "train", 0, {"i": 0}), Prompt)


def test_declared_reward_range():
    env = Scripted({"7": -1.0, "8": 2.0}, reward_range=(-1.0, 2.0))
    assert score_completion(env, "train", 0, {"i": 0}, "7").reward == -1.0
    with pytest.raises(EnvError, match=r"returned reward 2\.5, outside the environment's reward_range \[-1\.0, 2\.0\]"):
        score_completion(Scripted({"7": 2.5}, reward_range=(-1.0, 2.0)), "train", 0, {"i": 0}, "7")
    unbounded = (-math.inf, math.inf)  # what a verifiers taskset declares: finite is still required
    assert score_completion(Scripted({"7": 1e6}, reward_range=unbounded), "train", 0, {"i": 0}, "7").reward == 1e6
    with pytest.raises(EnvError, match=r"task train/0: score\(\) returned an infinite reward inf"):
        score_completion(Scripted({"7": math.inf}, reward_range=unbounded), "train", 0, {"i": 0}, "7")


def test_nan_rewards_skipped_are_counted_never_silently_dropped():
    # group 0 (task train/0): completions 7 8 9 10 -> NaN 0.5 0.5 1.0; group 1 the same. NaN samples are left out,
    # and both groups (whose remaining rewards differ) are kept and counted as having lost a sample
    env = Scripted({"7": float("nan"), "8": 0.5, "9": 0.5, "10": 1.0})
    batch = _orch(env, nan_rewards="skip").rollouts(step=1, policy_step=0)
    assert batch.stats["rollout/nan_rewards"] == 2 and batch.stats["rollout/nan_groups"] == 2
    assert batch.stats["rollout/samples"] == 6 and batch.stats["rollout/kept"] == 6
    assert batch.stats["reward/mean"] == pytest.approx(2 / 3)
    clean = _orch(Scripted({"8": 0.5})).rollouts(step=1, policy_step=0).stats
    assert clean["rollout/nan_rewards"] == 0 and clean["rollout/nan_groups"] == 0
    ev = _orch(env, nan_rewards="skip").evaluate()  # eval tasks 0-2: one greedy completion each, "7": all NaN
    assert ev["reward/eval_nan"] == 3 and math.isnan(ev["reward/eval_mean"])


def test_assign_advantages_refuses_a_nan_group_instead_of_dropping_it():
    """A NaN among a group's rewards used to decide its fate by its position: [0.5, NaN] has max = min = 0.5
    (comparisons with NaN are false), so the group looked all-equal and was dropped without a word; [NaN, 0.5] was
    kept with NaN advantages (a bare "loss is nan" later)."""
    nan, half = (Sample({}, 3, [1], [2], [-0.1], r, 0) for r in (float("nan"), 0.5))
    for group in ([half, nan], [nan, half]):
        with pytest.raises(InputError, match=r"group 3: non-finite reward\(s\) \[nan\]"):
            assign_advantages([group])
