"""RL environments: seeded tasks -> a prompt (token ids, optionally images) -> a completion's reward in [0, 1].

An `Environment` draws task `index` of a split from its own seeded generator (`task(split, index)`), so the data
order of a run is a function of the seed and the step, nothing to checkpoint. Train and held-out eval splits are
disjoint: a task belongs to the split its key hashes to (`eval_percent` of the keys are held out), and each split
draws only its own tasks.

Built in (no downloads):
- `reverse`: reverse a list of 3-8 symbols (words of the bundled SFT set, one token each); reward = the
  `difflib.SequenceMatcher` ratio of the answer and the reversed list (partial credit, as verifiers' reverse-text);
- `arith`: the sum or difference of two small integers; reward 1 for the exact number;
- `color`: a solid-colour image (composite model: through the engine and the vision tower), answer its colour name.
The prompts use the bundled SFT set's `Q: ...\\nA:` format, so a model warm-started on it answers in the expected
shape. A user's environment is any subclass named `module:Class` in the run config (`env.name`), built with
`env.args` as keyword arguments; `verifiers:NAME` is an installed verifiers taskset (`rl/verifiers_env.py`).

The orchestrator calls an environment only through `get_task`, `make_prompt` and `score_completion`: an exception
raised by the environment's `draw`, `prompt` or `score` becomes one `EnvError` line naming the environment, the task
(`train/17`: index 17 of the train split) and the exception (the original is its `__cause__`: `flashnext rl
--debug` prints it), and every reward is checked: a `Score` (built from a real number: `Score("0.5")` is a
`TypeError`; a bool is 1.0 / 0.0, a pass/fail reward) whose reward is finite and inside the environment's declared
`reward_range` (default [0, 1]). A NaN reward means "could not score": an error by default, or a skipped and counted
sample (`orchestrator.nan_rewards = "skip"`).
"""

from __future__ import annotations

import difflib
import importlib
import json
import math
import numbers
import os
import random
import re
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from flashnext.errors import ConfigError, FlashNextError

SYMBOLS = "red sun cat hat map cup box pen sea sky tree bird fish star moon rain road door book milk".split()


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


def _answer_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip()


class ReverseEnv(Environment):
    """Reverse `min_len`..`max_len` symbols: `Q: Reverse: a b c\\nA:` -> ` c b a`; SequenceMatcher ratio reward."""

    name = "reverse"

    def __init__(self, symbols: list[str] | None = None, min_len: int = 3, max_len: int = 8, **kw):
        super().__init__(**kw)
        self.symbols = list(symbols or SYMBOLS)
        if not 1 <= min_len <= max_len:
            raise ConfigError(f"reverse: need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.min_len, self.max_len = min_len, max_len

    def draw(self, rng):
        return {"symbols": [rng.choice(self.symbols) for _ in range(rng.randint(self.min_len, self.max_len))]}

    def prompt(self, task):
        return Prompt(self.encode(f"Q: Reverse: {' '.join(task['symbols'])}\nA:"))

    def score(self, task, completion):
        answer, target = _answer_line(completion), " ".join(reversed(task["symbols"]))
        ratio = difflib.SequenceMatcher(None, answer, target).ratio()
        return Score(ratio, {"exact": float(answer == target)})


class ArithEnv(Environment):
    """`Q: What is a plus b?\\nA:` -> ` c.` (and `minus`, never negative); reward 1 for the exact number."""

    name = "arith"

    def __init__(self, max_value: int = 50, ops: list[str] | None = None, **kw):
        super().__init__(**kw)
        self.max_value, self.ops = max_value, list(ops or ["plus", "minus"])
        if bad := sorted(set(self.ops) - {"plus", "minus"}):
            raise ConfigError(f"arith: unknown ops {bad} (plus, minus)")

    def draw(self, rng):
        op = rng.choice(self.ops)
        a = rng.randint(0, self.max_value)
        b = rng.randint(0, self.max_value) if op == "plus" else rng.randint(0, a)
        return {"a": a, "b": b, "op": op}

    def prompt(self, task):
        return Prompt(self.encode(f"Q: What is {task['a']} {task['op']} {task['b']}?\nA:"))

    def score(self, task, completion):
        want = task["a"] + task["b"] if task["op"] == "plus" else task["a"] - task["b"]
        found = re.search(r"-?\d+", _answer_line(completion))
        return Score(float(found is not None and int(found.group()) == want))


COLORS = {
    "red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (240, 220, 30),
    "black": (10, 10, 10), "white": (245, 245, 245), "orange": (250, 140, 20), "purple": (140, 40, 180),
}  # fmt: skip


class ColorEnv(Environment):
    """A solid-colour `size` x `size` image (each channel jittered by up to `jitter`): `Q: What color is this?
    <image>\\nA:` -> ` red.`; reward 1 for the colour's name. Needs a composite model (vision tower); the images go
    through transformers' image processor (the `vision` extra)."""

    name = "color"

    def __init__(self, colors: dict[str, list[int]] | None = None, size: int = 16, jitter: int = 12, **kw):
        super().__init__(**kw)
        self.colors = {k: tuple(v) for k, v in (colors or COLORS).items()}
        self.size, self.jitter = size, jitter
        self.processor = None

    def setup(self, tokenizer, model_config) -> None:
        super().setup(tokenizer, model_config)
        vision = getattr(model_config, "vision_config", None)
        if vision is None:
            raise ConfigError("env 'color' needs a composite model with a vision tower (model_type 'qwen4_exp')")
        from flashnext.vision_inputs import image_processor

        px = self.size * self.size
        self.processor = image_processor(vision, min_pixels=px, max_pixels=px)

    def draw(self, rng):
        name = rng.choice(sorted(self.colors))
        rgb = [min(255, max(0, c + rng.randint(-self.jitter, self.jitter))) for c in self.colors[name]]
        return {"color": name, "rgb": rgb}

    def prompt(self, task):
        from PIL import Image

        from flashnext.vision_inputs import image_span, process_images

        cfg = self.model_config
        image = Image.new("RGB", (self.size, self.size), tuple(task["rgb"]))
        inputs = process_images([image], cfg.vision_config, self.processor)
        span = image_span(inputs.num_tokens[0], cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
        ids = self.encode("Q: What color is this? ") + span + self.encode("\nA:")
        return Prompt(ids, inputs.pixel_values, inputs.image_grid_thw)

    def score(self, task, completion):
        answer = _answer_line(completion).lower().rstrip(".").strip()
        return Score(float(answer == task["color"]))


BUILTIN = {cls.name: cls for cls in (ReverseEnv, ArithEnv, ColorEnv)}


def load_environment(name: str, args: dict[str, Any] | None = None, **common) -> Environment:
    """A built-in environment by name, or a user's `module:Class` (a subclass of `Environment`), built with
    `args` and `common` (seed, eval_percent, max_tokens) as keyword arguments."""
    if name.startswith("verifiers:"):  # an installed verifiers taskset (the `verifiers` extra)
        from flashnext.rl.verifiers_env import VerifiersEnv

        return VerifiersEnv(name.removeprefix("verifiers:"), args, **common)
    if name in BUILTIN:
        cls = BUILTIN[name]
    elif ":" in name:
        module, _, attr = name.partition(":")
        if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: the working directory's modules
            sys.path.insert(0, os.getcwd())
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"env.name={name!r}: cannot import {attr!r} from {module!r} ({e})") from None
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ConfigError(f"env.name={name!r} is not a subclass of flashnext.rl.envs.Environment")
    else:
        raise ConfigError(f"env.name={name!r}: not a built-in environment ({', '.join(BUILTIN)}) or module:Class")
    try:
        return cls(**(args or {}), **common)
    except TypeError as e:
        raise ConfigError(f"env.args for {name!r}: {e}") from None
