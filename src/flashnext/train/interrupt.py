"""A run that stops keeps its work: SIGINT/SIGTERM and an exception inside the loop save a resumable checkpoint.

`keep_work(trainer, loop)` runs a trainer's step loop (`loop.train_loop`, for SFT and RL runs alike) with:
- **signals**: while the loop runs, the first SIGINT (Ctrl-C) or SIGTERM only sets a flag; the loop asks
  `stop.requested()` before each step, so the step in flight finishes, the checkpoint of the last completed step is
  saved and `RunInterrupted` ends the run: one line saying where the checkpoint is and how to continue; the
  command exits 128 + the signal (130 for SIGINT, 143 for SIGTERM). A second signal interrupts at once
  (`KeyboardInterrupt`, no checkpoint). Under torchrun the ranks agree (the flag is all-reduced each step: one
  tiny collective), so every rank stops after the same step and the sharded save stays collective.
- **failures**: an exception out of the loop saves the checkpoint of the last completed step first (unless no step
  completed since the loop started, or under torchrun, where one rank's failure cannot start a collective save;
  the last periodic checkpoint is the one to resume there), and adds a note saying where it is, which the
  commands' one-line error prints. The trainer's state is whole between steps: a step's rollouts, its forward and
  backward change nothing saved, a non-finite loss is refused before the optimizer steps (`Trainer.train_step`),
  and the weight sync and evaluation after an update leave the state at the new step.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from flashnext.errors import FlashNextError

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESUME_HINT = "to continue, run the same command with --resume (without --overwrite)"


class Checkpointed(Protocol):
    """What keeping the work needs of a trainer: its step, its `DistContext` and a checkpoint of the current step."""

    step: int
    ctx: Any

    def save_checkpoint(self) -> Any: ...


class RunInterrupted(FlashNextError):
    """A run stopped by SIGINT/SIGTERM after saving its checkpoint. `exit_code`: 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


class StopOnSignal:
    """While active (a `with` block in the main thread), SIGINT/SIGTERM set a flag instead of interrupting; a second
    one raises `KeyboardInterrupt`. Elsewhere than the main thread it installs nothing (and never stops).

    Args:
        ctx: the run's `DistContext` (under torchrun `requested` agrees over the ranks).
    """

    def __init__(self, ctx):
        self.ctx, self.signum, self._previous = ctx, 0, {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        if self.ctx.is_main:
            print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (again to stop at "
                  "once, without one)", file=sys.stderr, flush=True)  # fmt: skip

    def requested(self) -> int:
        """The signal the run was asked to stop by (0: none), the same on every rank (collective under torchrun)."""
        if not self.ctx.distributed:
            return self.signum
        import torch.distributed as dist

        flag = torch.tensor([self.signum], device=self.ctx.device if self.ctx.backend == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def keep_work(trainer: Checkpointed, loop: Callable[[StopOnSignal], list]) -> list:
    """`loop(stop)` (it calls `check_stop(trainer, stop)` before each step) with the module doc's signal and failure
    handling; returns what the loop returns."""
    start = trainer.step
    with StopOnSignal(trainer.ctx) as stop:
        try:
            return loop(stop)
        except RunInterrupted:
            raise
        except Exception as e:
            e.add_note(_save_after_failure(trainer, start))
            raise


def check_stop(trainer: Checkpointed, stop: StopOnSignal) -> None:
    """Between steps: on a stop request save the checkpoint of the last completed step and raise `RunInterrupted`."""
    signum = stop.requested()
    if not signum:
        return
    name = signal.Signals(signum).name
    path = trainer.save_checkpoint()
    raise RunInterrupted(f"stopped by {name} after step {trainer.step}: checkpoint {path}; {RESUME_HINT}", signum)


def _save_after_failure(trainer: Checkpointed, start: int) -> str:
    """Save the last completed step after a failure; the note to add to the error (where, or why not)."""
    if trainer.ctx.distributed:
        return "no checkpoint saved (under torchrun a failed rank cannot save collectively): resume from the newest one"
    if trainer.step == start:
        return f"no step completed since step {start}: nothing new to save"
    try:
        path = trainer.save_checkpoint()
    except Exception as e:  # the error being reported matters more
        return f"saving the checkpoint of step {trainer.step} failed too: {type(e).__name__}: {e}"
    return f"saved the checkpoint of step {trainer.step} (the last completed) to {path}; {RESUME_HINT}"
