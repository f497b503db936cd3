"""The training loop: one for every run. Its parts are plugged in.

    for each step: batches = source.next_step(step); metrics = trainer.train_step(batches); hook.after_step(...)

- a `BatchSource` gives each step's micro-batches for this rank: packed SFT data (`train/sft.py`; with context
  parallelism each micro-batch is this rank's slice of it), or RL rollouts from the inference engine or server
  (`rl/loop.py`). Its position is part of the checkpoint;
- the `Trainer` owns the model, the optimizers and one optimizer step (`Trainer.train_step`: forward and backward
  of the run's `Objective`, `train/objective.py`, clip, step);
- `Hook`s, in order, see each step's metrics and may add to them: the RL weight sync, the rollouts' statistics, the
  evaluation, the metrics file and progress bar, the periodic checkpoint (`train/hooks.py`);
- a `Workload` says which source and hooks a run uses, and what the run says at its start and end.
Between steps, a stop requested by SIGINT/SIGTERM saves a checkpoint and ends the run (`train/interrupt.py`).
"""

from __future__ import annotations

from typing import Any, Protocol

from flashnext.train.interrupt import StopOnSignal, check_stop

Metrics = dict[str, Any]


class Stepper(Protocol):
    """What the loop needs of the `Trainer`: its config, its step count, one optimizer step and a checkpoint."""

    cfg: Any
    step: int

    def train_step(self, batches: list) -> Metrics: ...

    def save_checkpoint(self) -> Any: ...


class BatchSource(Protocol):
    def next_step(self, step: int) -> list:
        """This rank's micro-batches of the step after `step` (collective where the source is shared)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The source's position, for the checkpoint (a resumed run continues with the same batches)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """After the run's last checkpoint: stop whatever the source runs in the background."""
        ...


class Hook(Protocol):
    def start(self, row: Metrics) -> None:
        """Before the first step; `row` is `{"step": s}`, an evaluation may add to it (then it is logged)."""
        ...

    def after_step(self, metrics: Metrics, last: bool) -> None:
        """After an optimizer step (`metrics["step"]` is its number; `last`: the run's final step)."""
        ...

    def close(self) -> None: ...


class Workload(Protocol):
    source: BatchSource

    def announce(self) -> None:
        """Before the loop (after resuming): say what the run does (RL: first sends the weights to the engine)."""
        ...

    def hooks(self) -> list[Hook]:
        """The hooks of this run's loop, in the order they see each step."""
        ...

    def summary(self, history: list[Metrics]) -> str | None:
        """The run's closing line."""
        ...


def train_loop(trainer: Stepper, source: BatchSource, hooks: list[Hook], stop: StopOnSignal) -> list[Metrics]:
    """The steps from the trainer's current one to `train.steps`; returns their metrics (and a start row, if any)."""
    history: list[Metrics] = []
    try:
        start = {"step": trainer.step}
        for hook in hooks:
            hook.start(start)
        if len(start) > 1:
            history.append(start)
        while trainer.step < trainer.cfg.train.steps:
            check_stop(trainer, stop)
            metrics = trainer.train_step(source.next_step(trainer.step))
            last = trainer.step == trainer.cfg.train.steps
            for hook in hooks:
                hook.after_step(metrics, last)
            history.append(metrics)
    finally:
        for hook in hooks:
            hook.close()
    return history
