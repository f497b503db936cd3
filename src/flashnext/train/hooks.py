"""The training loop's hooks shared by SFT and RL runs: evaluation, the metrics file and bar, periodic checkpoints.

Each sees a step's metrics after the optimizer step (`loop.Hook`), in the order the run lists them: the evaluation
adds its numbers first, so the metrics line and the bar show them; the checkpoint comes last.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashnext.train.metrics import MetricsLogger, ProgressBar

Metrics = dict[str, Any]


def every(step: int, period: int) -> bool:
    """`step` is a multiple of `period` (never when `period` is 0: off)."""
    return period > 0 and step % period == 0


class Evaluation:
    """Every `period` steps and after the last, `evaluate()`'s metrics join the step's.

    Args:
        evaluate: the held-out metrics (`{"eval_loss": ...}`, `{"reward/eval_mean": ..., ...}`).
        period: steps between evaluations (0: after the last step only).
        at_start: also evaluate before the first step of a fresh run (the RL baseline, logged as step 0).
    """

    def __init__(self, evaluate: Callable[[], Metrics], period: int, at_start: bool = False):
        self.evaluate, self.period, self.at_start = evaluate, period, at_start

    def start(self, row: Metrics) -> None:
        if self.at_start and row["step"] == 0:
            row.update(self.evaluate())

    def after_step(self, metrics: Metrics, last: bool) -> None:
        if last or every(metrics["step"], self.period):
            metrics.update(self.evaluate())

    def close(self) -> None:
        pass


class Report:
    """`metrics.jsonl` (every `log_every` steps, the last, and each step with an evaluation) and the progress bar.

    Args:
        path: the metrics file (rank 0 writes it; on resume from step s, later lines are dropped).
        step: the run's current step; total: `train.steps`.
        main: this is rank 0 (the others write nothing); progress: show the bar.
        bar: the progress bar class (`ProgressBar`, `RLProgressBar`); eval_key: the metric an evaluation sets.
        say: where lines go when there is no bar.
    """

    def __init__(self, path: Path, step: int, total: int, log_every: int, *, main: bool, progress: bool,
                 wandb: str | None, bar: type[ProgressBar], eval_key: str, say: Callable[[str], Any]):  # fmt: skip
        self.logger = MetricsLogger(path, enabled=main, resume_step=step, wandb=wandb)
        self.bar = bar(total, step, enabled=progress and main)
        self.log_every, self.eval_key, self.say = log_every, eval_key, say

    @classmethod
    def of_run(cls, trainer, bar: type[ProgressBar], eval_key: str) -> Report:
        """The report of `trainer`'s run (a `Trainer`: its out_dir, step, config `log` section, rank, `say`)."""
        cfg, log = trainer.cfg, trainer.cfg.log
        return cls(trainer.out_dir / "metrics.jsonl", trainer.step, cfg.train.steps, log.every,
                   main=trainer.ctx.is_main, progress=log.progress, wandb=log.wandb_project, bar=bar,
                   eval_key=eval_key, say=trainer.say)  # fmt: skip

    def start(self, row: Metrics) -> None:
        if len(row) > 1:  # an evaluation before the first step
            self.logger.log(row)
            self.bar.note(row)

    def after_step(self, metrics: Metrics, last: bool) -> None:
        self.bar.update(metrics)
        if metrics["step"] % self.log_every == 0 or last or self.eval_key in metrics:
            self.logger.log(metrics)

    def write(self, line: str) -> None:
        """A line above the bar."""
        self.bar.write(line, self.say)

    def close(self) -> None:
        self.bar.close()
        self.logger.close()


class PeriodicCheckpoint:
    """Every `period` steps except the last (the run saves that one after the loop), a checkpoint.

    Args:
        save: writes the checkpoint of the current step, returns its path (`Trainer.save_checkpoint`).
        write: where the line naming it goes (`Report.write`).
    """

    def __init__(self, save: Callable[[], Path], period: int, write: Callable[[str], Any]):
        self.save, self.period, self.write = save, period, write

    def start(self, row: Metrics) -> None:
        pass

    def after_step(self, metrics: Metrics, last: bool) -> None:
        if every(metrics["step"], self.period) and not last:
            t0 = time.perf_counter()
            path = self.save()
            self.write(f"checkpoint: {path} ({time.perf_counter() - t0:.1f}s)")

    def close(self) -> None:
        pass
