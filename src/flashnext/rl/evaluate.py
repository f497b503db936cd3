"""`flashnext rl --eval-only CHECKPOINT`: the held-out reward of a checkpoint, mean ± standard error, no training.

The checkpoint is a training checkpoint (`<out_dir>/checkpoints/step_N`: the model is built as the run config says,
from `model.path`, then the checkpoint's weights are loaded) or an exported model (`<out_dir>/final`, any directory
with a `config.json`: it becomes `model.path`). The weights go to an engine in this process (never to a server:
`inference.url` is ignored) and the first N tasks of the environment's held-out split are scored, one completion
each at `orchestrator.eval_temperature` (the shipped recipe's is 0: greedy). The tasks are the same for every
checkpoint of a run config, so two checkpoints' per-task rewards (kept in the JSON) pair up.

N defaults to 512: a reward in [0, 1] has a standard deviation of at most 0.5, so the standard error is at most
0.5 / sqrt(512) = 0.022, and that of a difference of two checkpoints at most 0.031, well below the tiny recipe's gain
(~0.2-0.3: README, "RL"). The held-out tasks are independent draws from the eval split; a split with fewer distinct
tasks than N (the tiny recipe's has 29) repeats them, and the standard error is then that of the mean over the
split's task distribution (the JSON and the line say how many were distinct).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flashnext.checkpoint import training as ckpt
from flashnext.errors import ConfigError
from flashnext.rl.config import RLRunConfig
from flashnext.rl.envs import Score

DEFAULT_TASKS = 512


def _mean_stderr(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n if n else float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else float("nan")
    return mean, (var / n) ** 0.5


def _run_config(cfg: RLRunConfig, path: Path, tasks: int) -> tuple[RLRunConfig, bool]:
    """The run config the evaluation builds from, and whether `path` is a training checkpoint."""
    if not path.exists():
        raise ConfigError(f"--eval-only {str(path)!r} does not exist")
    training = (path / ckpt.META_FILE).exists()
    if not training and not (path / "config.json").exists():
        raise ConfigError(f"--eval-only {str(path)!r} is neither a training checkpoint ({ckpt.META_FILE}) nor an "
                          "exported model (config.json)")  # fmt: skip
    model = cfg.model
    if not training:
        model = model.model_copy(update={"path": str(path)})
    elif model.path is not None and not Path(model.path).exists():
        raise ConfigError(f"--eval-only {str(path)!r}: the run's model.path={model.path!r} (its model, whose weights "
                          "the checkpoint replaces) does not exist")  # fmt: skip
    return cfg.model_copy(update={
        "model": model,
        "orchestrator": cfg.orchestrator.model_copy(update={"eval_tasks": tasks}),
        "inference": cfg.inference.model_copy(update={"url": None}),
        "checkpoint": cfg.checkpoint.model_copy(update={"resume": None}),
    }), training  # fmt: skip


def evaluate_checkpoint(cfg: RLRunConfig, checkpoint: str | Path, tasks: int = DEFAULT_TASKS, say=print,
                        warn=print) -> dict[str, Any]:  # fmt: skip
    """Score `tasks` held-out tasks with the weights of `checkpoint` (see the module doc); print one line, write
    `<out_dir>/eval/<checkpoint's path>.json` (`_name`) and return what it holds."""
    from flashnext.rl.loop import rl_trainer

    if tasks < 2:
        raise ConfigError(f"--eval-tasks {tasks}: need at least 2 tasks for a standard error")
    path = Path(checkpoint)
    cfg, training = _run_config(cfg, path, tasks)
    step = None
    if training:
        meta = ckpt.load_meta(path)
        step = meta["step"]
        trained_on = (meta.get("run_config") or {}).get("env")
        if trained_on is not None and trained_on != cfg.env.model_dump(mode="json"):
            warn(f"warning: {path} was trained on env {json.dumps(trained_on)}; evaluating on "
                 f"{json.dumps(cfg.env.model_dump(mode='json'))} (pass that run's --config)")  # fmt: skip
    trainer = rl_trainer(cfg, say=lambda *a, **k: None)
    if training:
        trainer.load_checkpoint(path, ckpt.read_checkpoint(path))
    rl = trainer.workload
    rl.sync_weights(full=True)
    drawn, scores = rl.source.orch.eval_scores(tasks)
    out = _report(cfg, path, step, drawn, scores, len({rl.source.env.key(t) for t in drawn}))
    dest = Path(cfg.out_dir) / "eval" / f"{_name(path, Path(cfg.out_dir))}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, dest)
    extra = "".join(f"; {k} {v['mean']:.3f} ± {v['stderr']:.3f}" for k, v in out["metrics"].items())
    nan = f", {out['nan']} NaN rewards left out" if out["nan"] else ""
    say(f"eval-only: {path} (env {cfg.env.name!r}, held-out split): reward {out['reward_mean']:.3f} ± "
        f"{out['reward_stderr']:.3f} (mean ± stderr over {tasks} tasks, {out['distinct_tasks']} distinct, "
        f"{out['sampling']}{nan}){extra}; metrics in {dest}")  # fmt: skip
    return out


def _name(path: Path, out_dir: Path) -> str:
    """A file name for `path`'s results: its path inside `out_dir` (`checkpoints_step_00000120`, `final`), else its
    absolute path (`tmp_runs_tiny-sft_final`), `/` -> `_`: two checkpoints never share one."""
    path, out_dir = path.resolve(), out_dir.resolve()
    rel = path.relative_to(out_dir) if path.is_relative_to(out_dir) and path != out_dir else path
    return "_".join(p for p in rel.parts if p.strip("/"))


def _report(cfg: RLRunConfig, path: Path, step, drawn: list, scores: list[Score], distinct: int) -> dict[str, Any]:
    temperature = cfg.orchestrator.eval_temperature
    kept = [s for s in scores if s.reward == s.reward]  # NaN only with orchestrator.nan_rewards="skip"
    mean, stderr = _mean_stderr([s.reward for s in kept])
    metrics = {k: dict(zip(("mean", "stderr"), _mean_stderr([s.metrics.get(k, 0.0) for s in kept]), strict=True))
               for k in sorted({k for s in kept for k in s.metrics})}  # fmt: skip
    return {
        "checkpoint": str(path), "step": step, "env": cfg.env.name, "env_args": cfg.env.args, "split": "eval",
        "tasks": len(scores), "distinct_tasks": distinct, "temperature": temperature,
        "sampling": "greedy" if temperature == 0 else f"temperature {temperature}",
        "reward_mean": mean, "reward_stderr": stderr,
        "nan": len(scores) - len(kept), "metrics": metrics,
        "rewards": [s.reward if s.reward == s.reward else None for s in scores],
    }  # fmt: skip
