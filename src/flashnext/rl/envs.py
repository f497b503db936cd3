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
- `calc`: multi-turn with a calculator tool (`rl/tool_env.py`): the model calls it, the result comes back as the
  chat template renders a tool result, the final answer is scored.
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
import os
import re
import sys
from typing import Any

from flashnext.errors import ConfigError
from flashnext.rl.environment import (  # the base types, importable from here as before
    EnvError,
    Environment,
    Prompt,
    Score,
    get_task,
    make_prompt,
    score_completion,
)
from flashnext.rl.tool_env import CalcEnv

__all__ = [
    "BUILTIN", "ArithEnv", "ColorEnv", "EnvError", "Environment", "Prompt", "ReverseEnv", "Score", "get_task",
    "load_environment", "make_prompt", "score_completion",
]  # fmt: skip

SYMBOLS = "red sun cat hat map cup box pen sea sky tree bird fish star moon rain road door book milk".split()


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


BUILTIN = {cls.name: cls for cls in (ReverseEnv, ArithEnv, ColorEnv, CalcEnv)}


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
