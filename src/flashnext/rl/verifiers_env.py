"""A verifiers (0.4.0) taskset as a flashnext RL environment: `env.name = "verifiers:NAME"` (or `flashnext rl
--env verifiers:NAME`), `env.args` the taskset's config fields.

`NAME` is what verifiers calls a taskset id: an installed package (module `NAME` with `-` as `_`) exporting one
`vf.Taskset` subclass in `__all__`, loaded as verifiers loads it (`vf.taskset_config_type(NAME)` validates
`{"id": NAME, **env.args}`, `vf.load_taskset` builds it). Its tasks become ours:
- splits: each task goes to the split its verifiers `task.key` hashes to (`eval_percent` held out, as every flashnext
  environment); a split's tasks are visited in a seeded shuffled order, epoch after epoch, so train task `i` is the
  same on every run with the seed and held-out tasks repeat only after the whole split has been evaluated;
- prompt: the task's `system_prompt` and `prompt` (a string is one user message; messages pass through, text only)
  rendered by the run's tokenizer's chat template with the generation prompt;
- score: the completion becomes the assistant message of a `vf.Trace` of that conversation and the task's own
  `score()` runs on it (its `@vf.reward` / `@vf.metric` methods and plugged functions, async, run to completion
  with asyncio); the reward is the trace's, `sum(score * weight)` as verifiers sums it, and each reward's unweighted
  score and each metric is logged (`reward/<name>`).

Single-turn only: flashnext plays the taskset as verifiers' plain chat harness (`null`) does for a task without
tools: the prompt, one reply (verifiers' own default for a plain taskset is its `bash` agent harness, which runs
the rollout as a program in a sandbox; flashnext does not run harness programs). A taskset
whose rollout is more than that is refused with a one-line error saying why: its package defines its own `Env`
(agents, simulated users) or harness, its tasks use tools (`toolsets`), need a container or a runtime (a reward,
metric, `setup` or `finalize` taking `runtime`), use judges (a judge model) or `@vf.stop` hooks (turn control).
verifiers is imported only here, when such an environment is asked for (`pip install 'flashnext[verifiers]'`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
from typing import Any

from flashnext.errors import ConfigError
from flashnext.rl.environment import Environment, Prompt, Score

PREFIX = "verifiers:"


def import_verifiers(env_name: str):
    """`verifiers.v1`, or a one-line `ConfigError` saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f"env.name={env_name!r} needs the verifiers package ({e}); install it with "
                          "pip install 'flashnext[verifiers]'") from None  # fmt: skip
    return vf


def _one_line(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):  # a pydantic ValidationError: each field and its problem
        try:
            return "; ".join(f"{'.'.join(map(str, d['loc'])) or 'config'}: {d['msg']}" for d in errors())
        except Exception:
            pass
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _needs_runtime(fn) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def multi_turn_reason(vf, taskset_id: str, taskset, task) -> str | None:
    """Why a rollout of this taskset is more than one prompt and one reply (None: it is not)."""
    env_cls = vf.environment_class(taskset_id)
    if env_cls is not vf.SingleAgentEnv:
        return f"its package defines its own Env ({env_cls.__name__}: several agents or a simulated user take turns)"
    if vf.default_harness_id(taskset_id) != "bash":
        return "its package ships its own harness (a program that runs the rollout)"
    if type(taskset).toolsets(taskset.config) or type(task).toolsets(task.config):
        return "its tasks call tools (a multi-turn rollout)"
    if type(task).NEEDS_CONTAINER:
        return "its tasks need a container"
    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            return f"its task's {hook}() prepares a runtime (sandbox)"
    if hooks := [fn.__name__ for fn in (*task.hooks("reward"), *task.hooks("metric")) if _needs_runtime(fn)]:
        return f"its scoring ({', '.join(hooks)}) needs a runtime (sandbox)"
    if task.config.judges:
        return "it scores with judges (a judge model)"
    if task.hooks("stop"):
        return "it has @vf.stop hooks (turn control)"
    return None


class VerifiersEnv(Environment):
    """An installed verifiers taskset's tasks, prompts and rewards (see the module doc).

    Args:
        taskset_id: the verifiers taskset id (`NAME` of `verifiers:NAME`).
        args: the taskset config's fields (`env.args`).
        seed, eval_percent, max_tokens: as `Environment`'s.
    """

    # a verifiers reward is its rubric's weighted sum, whose range the taskset does not declare: any finite value
    reward_range = (-math.inf, math.inf)

    def __init__(self, taskset_id: str, args: dict[str, Any] | None = None, **common):
        super().__init__(**common)
        self.name = PREFIX + taskset_id
        if not taskset_id:
            raise ConfigError(f"env.name={self.name!r}: name the verifiers taskset after 'verifiers:'")
        self.vf = vf = import_verifiers(self.name)
        try:
            config = vf.taskset_config_type(taskset_id).model_validate({**(args or {}), "id": taskset_id})
            taskset = vf.load_taskset(config)
            if not taskset.bounded:
                raise ValueError("it yields tasks forever; bound it with its config (env.args)")
            tasks = list(taskset)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"env.name={self.name!r}: {_one_line(e)}") from None
        if not tasks:
            raise ConfigError(f"env.name={self.name!r}: the taskset has no tasks")
        if (why := multi_turn_reason(vf, taskset_id, taskset, tasks[0])) is not None:
            raise ConfigError(f"env.name={self.name!r}: flashnext runs single-turn verifiers tasksets (a prompt, one "
                              f"reply, the task's rewards); {why}: multi-turn is not supported")  # fmt: skip
        self.tasks = tasks
        self.order: dict[str, list[int]] = {}
        for split in ("train", "eval"):
            ids = [i for i, t in enumerate(tasks) if self.split_of({"index": i}) == split]
            if not ids:
                raise ConfigError(f"env.name={self.name!r}: its {len(tasks)} tasks leave the {split} split empty at "
                                  f"env.eval_percent={self.eval_percent}")  # fmt: skip
            random.Random(f"{self.seed}:{split}").shuffle(ids)
            self.order[split] = ids

    def setup(self, tokenizer, model_config) -> None:
        if tokenizer is None:
            raise ConfigError(f"env {self.name!r} renders chat prompts: the model needs a tokenizer")
        super().setup(tokenizer, model_config)

    # ---- tasks -------------------------------------------------------------------------------------------
    def key(self, task: dict[str, Any]) -> str:
        return self.tasks[task["index"]].key

    def task(self, split: str, index: int) -> dict[str, Any]:
        """Task `index` of `split`: position `index` of the split's seeded order, cycling (epochs)."""
        order = self.order[split]
        i = order[index % len(order)]
        return {"index": i, "id": self.tasks[i].data.id}

    def draw(self, rng: random.Random) -> dict[str, Any]:
        i = rng.randrange(len(self.tasks))
        return {"index": i, "id": self.tasks[i].data.id}

    # ---- prompt and score --------------------------------------------------------------------------------
    def messages(self, task: dict[str, Any]) -> list:
        """The conversation the model answers, as verifiers messages (system prompt first)."""
        vf, data = self.vf, self.tasks[task["index"]].data
        out = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt is not None else []
        if isinstance(data.prompt, str):
            out.append(vf.UserMessage(content=data.prompt))
        else:
            out.extend(data.prompt or [])
        return out

    def prompt(self, task: dict[str, Any]) -> Prompt:
        chat = []
        for m in self.messages(task):
            if not isinstance(m.content, str | None) and any(p.type != "text" for p in m.content):
                raise ConfigError(f"env {self.name!r} task {task['index']}: a {m.role} message has non-text content "
                                  "(images are not supported through verifiers tasksets)")  # fmt: skip
            chat.append({"role": m.role, "content": self.vf.types.content_text(m.content) if m.content else ""})
        return Prompt(list(self.tokenizer.apply_chat_template(chat, add_generation_prompt=True)))

    def score(self, task: dict[str, Any], completion: str) -> Score:
        """Run the task's verifiers scoring on the conversation ending in `completion` (see the module doc)."""
        trace = self.trace(task, completion)
        asyncio.run(self.tasks[task["index"]].score(trace))
        unscored = [name for name, r in trace.rewards.items() if r is None]
        if unscored:
            raise ValueError(f"env {self.name!r} task {json.dumps(task)}: rewards {unscored} were not scored")
        metrics = {name: r.score for name, r in trace.rewards.items()}
        metrics.update({name: v for name, v in trace.metrics.items() if v is not None})
        return Score(float(trace.reward), metrics)

    def trace(self, task: dict[str, Any], completion: str):
        """A finished one-turn `vf.Trace`: the prompt's messages, then `completion` as the sampled reply."""
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, TraceTask

        vf, t = self.vf, self.tasks[task["index"]]
        messages = [*self.messages(task), vf.AssistantMessage(content=completion)]
        nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=i == len(messages) - 1)
                 for i, m in enumerate(messages)]  # fmt: skip
        return vf.Trace(task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
                        agent=AgentInfo(config=AgentConfig()), nodes=nodes, is_completed=True,
                        ok=True)  # fmt: skip
