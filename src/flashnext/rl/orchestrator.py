"""The orchestrator: each step's tasks -> group samples from the inference engine -> rewards -> advantages.

Step s (1-based) samples `group_size` completions of tasks `(s - 1) * batch_size ... s * batch_size - 1` of the
environment's train split; prompt i's seed is derived from `(orchestrator.seed, s, i)`, so what a step samples
depends only on the seeds and the weights that sampled it, never on timing or batching: nothing but the rollouts
already sampled for future steps needs a checkpoint.

Off-policy pipeline (`RolloutPipeline`, `max_off_policy_steps` = k): at the start of trainer step s the engine holds
the policy of step s - 1 and the pipeline launches the rollouts of step s + k with it, on a worker thread, while the
trainer takes step s; the weight sync after step s waits for that worker (in-flight requests finish on the old
weights). So step s trains on rollouts sampled by policy `max(0, s - 1 - k)`: staleness k (less in the first k
steps), the same on every run. k = 0 is synchronous. A batch whose staleness exceeds the bound (e.g. a run resumed
with a smaller k) is dropped and counted, and the step's rollouts are sampled afresh.

The environment is called through `envs.get_task` / `make_prompt` / `score_completion` (errors name the environment
and the task; rewards are checked). A NaN reward is an error unless `nan_rewards="skip"`: then the sample is left
out of its group, like a failed completion, and counted (`rollout/nan_rewards` samples, `rollout/nan_groups` groups
that lost one or more; `reward/eval_nan` in an evaluation), never dropped silently.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field

from flashnext.rl.envs import Environment, Prompt, Score, get_task, make_prompt, score_completion
from flashnext.rl.inference import GenRequest, SamplingSpec
from flashnext.rl.rollouts import Sample, assign_advantages
from flashnext.rl.tool_env import ToolEnvironment, respond
from flashnext.serve.sampling import choice_seed

_FAILED = ("error", "abort")


@dataclass
class RolloutBatch:
    """The scored samples of one step (after advantages and the zero-advantage filter) and their statistics."""

    step: int
    policy_step: int
    samples: list[Sample]
    stats: dict[str, float] = field(default_factory=dict)

    def state(self) -> dict:
        return {"step": self.step, "policy_step": self.policy_step, "stats": dict(self.stats),
                "samples": [asdict(s) for s in self.samples]}  # fmt: skip

    @classmethod
    def from_state(cls, d: dict) -> RolloutBatch:
        return cls(d["step"], d["policy_step"], [Sample(**s) for s in d["samples"]], dict(d["stats"]))


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


class Orchestrator:
    """Samples and scores the rollouts of a step, and evaluates the held-out split.

    Args:
        env: the environment (set up with the run's tokenizer and model config).
        client: a `LocalInference` or `RemoteInference`.
        spec: how training rollouts are sampled (temperature, budget, stop ids, routed experts).
        batch_size, group_size: prompts per step, completions per prompt.
        seed: the sampling seed; std_normalize, drop_zero: the advantage options.
        eval_tasks, eval_temperature: the held-out evaluation.
        nan_rewards: "error" (a NaN reward stops the run) or "skip" (the sample is left out and counted).
    """

    def __init__(self, env: Environment, client, spec: SamplingSpec, batch_size: int, group_size: int, seed: int = 0,
                 std_normalize: bool = False, drop_zero: bool = True, eval_tasks: int = 64,
                 eval_temperature: float = 0.0, nan_rewards: str = "error"):  # fmt: skip
        self.env, self.client, self.spec = env, client, spec
        self.batch_size, self.group_size, self.seed = batch_size, group_size, seed
        self.std_normalize, self.drop_zero = std_normalize, drop_zero
        self.eval_tasks, self.eval_temperature = eval_tasks, eval_temperature
        self.allow_nan = {"error": False, "skip": True}[nan_rewards]

    def prompt_seed(self, step: int, i: int) -> int:
        return choice_seed(choice_seed(self.seed, step + 1), i + 1)

    def _sample(self, split: str, indices: list[int], n: int, spec: SamplingSpec, step: int):
        """[(task, [Choice])] for the tasks of `split` at `indices`, n completions each (every turn of a
        multi-turn environment's episode: `_more_turns`)."""
        tasks = [get_task(self.env, split, i) for i in indices]
        prompts = [make_prompt(self.env, split, i, t) for i, t in zip(indices, tasks, strict=True)]
        reqs = [GenRequest(p, n, self.prompt_seed(step, j)) for j, p in enumerate(prompts)]
        if not isinstance(self.env, ToolEnvironment):
            return tasks, reqs, self.client.generate(reqs, spec)
        spec = SamplingSpec(spec.max_tokens, spec.temperature, spec.stop_token_ids + self.env.turn_stop_ids(),
                            spec.routed_experts)  # fmt: skip
        results = self.client.generate(reqs, spec)
        self._more_turns(split, indices, tasks, reqs, results, spec)
        return tasks, reqs, results

    def _more_turns(self, split, indices, tasks, reqs, results, spec: SamplingSpec) -> None:
        """Continue each episode while the environment responds: the next turn is sampled from the prompt, every
        id sampled so far and the environment's ids (its own seed, from the prompt's and the turn); the choice
        grows in place (`loss_mask` 0 on the environment's ids; routed experts of the last request, which cover
        the whole sequence)."""
        live = [(g, k, c, [c.token_ids]) for g, choices in enumerate(results) for k, c in enumerate(choices)]
        stops = set(self.env.turn_stop_ids())
        for turn in range(1, self.env.max_turns):
            todo = []
            for g, k, c, turns in live:
                if c.finish_reason != "stop" or not c.token_ids or c.token_ids[-1] not in stops:
                    continue
                texts = [self.env.tokenizer.decode(t, skip_special_tokens=False) for t in turns]
                reply = respond(self.env, split, indices[g], tasks[g], texts)
                if reply:
                    todo.append(((g, k, c, turns), reply))
            if not todo:
                return
            more = [GenRequest(Prompt(reqs[g].prompt.ids + c.token_ids + reply), 1,
                               choice_seed(reqs[g].seed, 1000 * turn + k)) for (g, k, c, _), reply in todo]  # fmt: skip
            outs = self.client.generate(more, spec)
            for ((_, _, c, turns), reply), (o,) in zip(todo, outs, strict=True):
                mask = c.loss_mask if c.loss_mask is not None else [1] * len(c.token_ids)
                c.loss_mask = mask + [0] * len(reply) + [1] * len(o.token_ids)
                c.token_ids = c.token_ids + reply + o.token_ids
                c.logprobs = c.logprobs + [0.0] * len(reply) + list(o.logprobs)
                c.finish_reason, c.routed, c.error = o.finish_reason, o.routed, o.error
                turns.append(o.token_ids)
            live = [entry for entry, _ in todo]

    def _score(self, split: str, index: int, task, token_ids):
        return score_completion(self.env, split, index, task, self.env.tokenizer.decode(token_ids), self.allow_nan)

    def rollouts(self, step: int, policy_step: int) -> RolloutBatch:
        """Sample, score and weigh the rollouts of trainer step `step` with the engine's current weights (those of
        trainer step `policy_step`)."""
        t0 = time.perf_counter()
        first = (step - 1) * self.batch_size
        tasks, reqs, results = self._sample("train", list(range(first, first + self.batch_size)), self.group_size,
                                            self.spec, step)  # fmt: skip
        groups, failed, tokens, nan_rewards, nan_groups = [], 0, 0, 0, 0
        for g, (task, req, choices) in enumerate(zip(tasks, reqs, results, strict=True)):
            group, nans = [], 0
            for c in choices:
                tokens += len(c.token_ids)
                if c.finish_reason in _FAILED or not c.token_ids:
                    failed += 1
                    continue
                score = self._score("train", first + g, task, c.token_ids)
                if math.isnan(score.reward):  # only with nan_rewards="skip": left out like a failed completion
                    nans += 1
                    continue
                group.append(Sample(
                    task, g, list(req.prompt.ids), list(c.token_ids), list(c.logprobs), float(score.reward),
                    policy_step, c.finish_reason, dict(score.metrics), c.routed, req.prompt.pixel_values,
                    req.prompt.image_grid_thw, loss_mask=c.loss_mask,
                ))  # fmt: skip
            groups.append(group)
            nan_rewards, nan_groups = nan_rewards + nans, nan_groups + (nans > 0)
        everything = [s for group in groups for s in group]
        kept, dropped = assign_advantages(groups, self.std_normalize, self.drop_zero)
        seconds = time.perf_counter() - t0
        mean, std = _mean_std([s.reward for s in everything])
        stats = {"reward/mean": mean, "reward/std": std, "rollout/samples": len(everything),
                 "rollout/kept": len(kept), "rollout/groups_zero_advantage": dropped, "rollout/failed": failed,
                 "rollout/nan_rewards": nan_rewards, "rollout/nan_groups": nan_groups,
                 "rollout/completion_tokens": tokens, "rollout/seconds": seconds,
                 "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}  # fmt: skip
        for key in sorted({k for s in everything for k in s.metrics}):
            stats[f"reward/{key}"] = _mean_std([s.metrics.get(key, 0.0) for s in everything])[0]
        return RolloutBatch(step, policy_step, kept, stats)

    def eval_scores(self, n: int) -> tuple[list[dict], list[Score]]:
        """The first `n` held-out tasks and the score of one completion of each at `eval_temperature` (the same
        tasks and, greedy, the same completions for the same weights: scores of two checkpoints pair up)."""
        spec = SamplingSpec(self.spec.max_tokens, self.eval_temperature, self.spec.stop_token_ids, False)
        tasks, _, results = self._sample("eval", list(range(n)), 1, spec, step=-1)
        return tasks, [self._score("eval", i, t, r[0].token_ids) for i, (t, r) in enumerate(zip(tasks, results,
                                                                                                 strict=True))]

    def evaluate(self) -> dict[str, float]:
        """Mean, std and standard error of the reward (and each metric's mean) over the first `eval_tasks`
        held-out tasks, one completion each at `eval_temperature`; NaN rewards (`nan_rewards="skip"`) are left out
        and counted in `reward/eval_nan`."""
        if not self.eval_tasks:
            return {}
        _, scores = self.eval_scores(self.eval_tasks)
        return eval_summary(scores)


def eval_summary(scores: list[Score]) -> dict[str, float]:
    """`reward/eval_mean`, `_std` (population), `_stderr` (sample std / sqrt(n)), `_nan` (NaN rewards left out),
    and `reward/eval_<metric>` means, over `scores`."""
    kept = [s for s in scores if not math.isnan(s.reward)]
    rewards = [s.reward for s in kept]
    mean, std = _mean_std(rewards)
    n = len(rewards)
    stderr = std * (n / (n - 1)) ** 0.5 / n**0.5 if n > 1 else float("nan")
    out = {"reward/eval_mean": mean, "reward/eval_std": std, "reward/eval_stderr": stderr,
           "reward/eval_nan": len(scores) - n}  # fmt: skip
    for key in sorted({k for s in kept for k in s.metrics}):
        out[f"reward/eval_{key}"] = _mean_std([s.metrics.get(key, 0.0) for s in kept])[0]
    return out


class RolloutPipeline:
    """Rollouts sampled ahead of the trainer by up to `max_off_policy_steps` steps (see the module doc).

    Args:
        orch: the orchestrator; max_off_policy_steps: k (0: sample each step's rollouts when it needs them).
    """

    def __init__(self, orch: Orchestrator, max_off_policy_steps: int):
        self.orch, self.k = orch, max_off_policy_steps
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="flashnext-rollouts") if self.k else None
        self.jobs: dict[int, Future | RolloutBatch] = {}
        self.dropped_stale = 0

    def launch(self, step: int, policy_step: int) -> None:
        """Start sampling the rollouts of `step` with the engine's current weights (no-op if already started)."""
        if step in self.jobs:
            return
        if self.pool is None:
            self.jobs[step] = self.orch.rollouts(step, policy_step)
        else:
            self.jobs[step] = self.pool.submit(self.orch.rollouts, step, policy_step)

    def get(self, step: int, policy_step: int) -> tuple[RolloutBatch, int]:
        """The rollouts of `step` (trained at current policy `policy_step`) and how many samples were dropped as
        too stale; a stale batch is replaced by one sampled now."""
        job = self.jobs.pop(step, None)
        batch = job.result() if isinstance(job, Future) else job
        dropped = 0
        if batch is not None and policy_step - batch.policy_step > self.k:
            dropped = len(batch.samples)
            batch = None
        if batch is None:
            self.wait_idle()
            batch = self.orch.rollouts(step, policy_step)
        self.dropped_stale += dropped
        return batch, dropped

    def wait_idle(self) -> None:
        """Wait until no rollout is being sampled (before the engine's weights change). A job that failed keeps its
        exception for `get` of its step to raise."""
        wait([j for j in self.jobs.values() if isinstance(j, Future)])

    def state_dict(self) -> dict:
        """The rollouts sampled for future steps (call when idle). A job that failed is left out: a resumed run
        samples that step afresh (this is what lets a run that failed in a rollout still save its checkpoint)."""
        self.wait_idle()
        batches = [j.result() if isinstance(j, Future) else j for j in self.jobs.values()
                   if not (isinstance(j, Future) and j.exception() is not None)]  # fmt: skip
        return {"pending": [b.state() for b in batches], "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict) -> None:
        self.jobs = {d["step"]: RolloutBatch.from_state(d) for d in state.get("pending", [])}
        self.dropped_stale = int(state.get("dropped_stale", 0))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
