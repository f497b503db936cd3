"""What an RL environment is, and the checked calls the orchestrator makes to one (`rl/envs.py` has the built-in
environments and `load_environment`; `rl/verifiers_env.py` adapts a verifiers taskset to the same interface).

An `Environment` draws task `index` of a split from its own seeded generator (`task(split, index)`), turns a task into
a `Prompt` and scores a completion with a `Score`. The orchestrator calls it only through `get_task`, `make_prompt`
and `score_completion`, which turn an exception or a bad reward into one `EnvError` line naming the environment and
the task (see `rl/envs.py`).
"""

from __future__ import annotations

import json
import math
import numbers
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from flashnext.errors import ConfigError, FlashNextError


@dataclass
class Prompt:
    """What the engine is given: token ids, and the images of the placeholder spans in them (composite models).

    Attributes:
        ids: prompt token ids.
        pixel_values: float [sum t*h*w, P] or None; image_grid_thw: int64 [n_images, 3] or None.
    """

    ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


class EnvError(FlashNextError):
    """An environment's `draw`, `prompt` or `score` raised or returned a bad reward; the message names the
    environment, the task (`split/index`) and the problem; an exception raised by the environment is the
    `__cause__`."""


def _real(value: Any, what: str) -> float:
    """`value` as a float, if it is a real number (a bool counts as 1.0 / 0.0; a string is refused)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (str, bytes)):
        return float(value)
    if not isinstance(value, (str, bytes)) and hasattr(type(value), "__float__"):  # a 0-d tensor, Decimal, ...
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r:.80}")


@dataclass
class Score:
    """A completion's reward (in its environment's `reward_range`, default [0, 1]) and named metrics (logged as
    `reward/<name>` means).

    Both are stored as floats; anything but a real number (a string, None, a list) is a `TypeError` naming it. A
    bool is 1.0 / 0.0 (a pass/fail reward). NaN is kept (it means "could not score"; see `score_completion`).
    """

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.reward = _real(self.reward, "Score.reward")
        if not isinstance(self.metrics, dict):
            raise TypeError(f"Score.metrics must be a dict of name -> number, got {type(self.metrics).__name__}")
        self.metrics = {str(k): _real(v, f"Score.metrics[{k!r}]") for k, v in self.metrics.items()}


class Environment:
    """Tasks, prompts and rewards of one RL task family. Subclasses implement `draw`, `prompt` and `score`.

    Args:
        seed: seed of the task generator (task `index` of a split is the same on every run with this seed).
        eval_percent: percent of task keys held out for evaluation (0-100).
        max_tokens: completion budget (tokens) the orchestrator samples with.
    """

    name = "env"
    reward_range: tuple[float, float] = (0.0, 1.0)
    """The rewards `score` may give (inclusive); a reward outside it stops the run with an `EnvError`."""

    def __init__(self, seed: int = 0, eval_percent: int = 10, max_tokens: int = 16):
        if not 0 < eval_percent < 100:
            raise ConfigError(f"env eval_percent must be in (0, 100), got {eval_percent}")
        self.seed, self.eval_percent, self.max_tokens = seed, eval_percent, max_tokens
        self.tokenizer = self.model_config = None

    def setup(self, tokenizer, model_config) -> None:
        """Called once before the first prompt with the run's tokenizer and model config (`TextConfig` or the
        composite `ModelConfig`)."""
        self.tokenizer, self.model_config = tokenizer, model_config

    # ---- what a subclass defines -------------------------------------------------------------------------
    def draw(self, rng: random.Random) -> dict[str, Any]:
        """One random task as JSON-able data."""
        raise NotImplementedError

    def prompt(self, task: dict[str, Any]) -> Prompt:
        raise NotImplementedError

    def score(self, task: dict[str, Any], completion: str) -> Score:
        raise NotImplementedError

    def key(self, task: dict[str, Any]) -> str:
        """What identifies a task (its split is chosen by hashing this)."""
        return json.dumps(task, sort_keys=True)

    # ---- provided ----------------------------------------------------------------------------------------
    def split_of(self, task: dict[str, Any]) -> str:
        return "eval" if zlib.crc32(self.key(task).encode()) % 100 < self.eval_percent else "train"

    def task(self, split: str, index: int) -> dict[str, Any]:
        """Task `index` of `split` ("train" or "eval"): deterministic in (seed, split, index)."""
        rng = random.Random(f"{self.seed}:{split}:{index}")
        for _ in range(10_000):
            task = _call(self, split, index, "draw", rng)
            if self.split_of(task) == split:
                return task
        raise ConfigError(f"environment {self.name!r} drew no {split} task in 10000 tries (is eval_percent sane?)")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))


def _call(env: Environment, split: str, index: int, method: str, *args):
    """`env.<method>(*args)` for task `split/index`; an exception becomes one `EnvError` line naming all three."""
    try:
        return getattr(env, method)(*args)
    except EnvError:
        raise
    except Exception as e:
        raise EnvError(f"{_where(env, split, index)}: {method}() raised {type(e).__name__}: {_one_line(e)}") from e


def _where(env: Environment, split: str, index: int) -> str:
    return f"environment {env.name!r} task {split}/{index}"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + "..." if len(text) > 300 else text


def get_task(env: Environment, split: str, index: int) -> dict[str, Any]:
    """`env.task(split, index)`; an exception (of `draw`, or of a subclass's own `task`, e.g. a dataset row
    lookup) raises `EnvError` naming the task."""
    return _call(env, split, index, "task", split, index)


def make_prompt(env: Environment, split: str, index: int, task: dict[str, Any]) -> Prompt:
    """`env.prompt(task)`, checked: an exception or a result that is not a `Prompt` raises `EnvError`."""
    prompt = _call(env, split, index, "prompt", task)
    if not isinstance(prompt, Prompt):
        raise EnvError(f"{_where(env, split, index)}: prompt() returned {type(prompt).__name__}, not a Prompt")
    return prompt


def score_completion(env: Environment, split: str, index: int, task: dict[str, Any], completion: str,
                     allow_nan: bool = False) -> Score:  # fmt: skip
    """`env.score(task, completion)`, checked: it must return a `Score` whose reward is finite and inside
    `env.reward_range` (NaN too when `allow_nan`: the caller counts and skips it); else `EnvError` naming the
    environment, the task and the value."""
    score = _call(env, split, index, "score", task, completion)
    where = _where(env, split, index)
    if not isinstance(score, Score):
        raise EnvError(f"{where}: score() returned {type(score).__name__} {score!r:.80}, not a Score")
    r, (lo, hi) = score.reward, env.reward_range
    if math.isnan(r):
        if allow_nan:
            return score
        raise EnvError(f"{where}: score() returned a NaN reward (orchestrator.nan_rewards='skip' skips and counts "
                       "such samples instead)")  # fmt: skip
    if math.isinf(r):
        raise EnvError(f"{where}: score() returned an infinite reward {r!r}")
    if not lo <= r <= hi:
        raise EnvError(f"{where}: score() returned reward {r!r}, outside the environment's reward_range [{lo}, {hi}]")
    return score
