"""The trainer's checkpoints: save `step_N`, load either format, resume the newest readable one.

A checkpoint holds the model, the optimizers and the trainer's state (`Trainer.trainer_state`: step, schedule, the
batch source's position, RNG states). One process writes `state.pt` (`checkpoint.training`); a process group writes
a sharded DCP checkpoint (`parallel.save_state`), which any world size (one process included) can read back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashnext.checkpoint import training as ckpt
from flashnext.errors import CheckpointError, ConfigError


class Checkpointer:
    """Checkpoints of `trainer` (a `Trainer`: its model, optimizers, `trainer_state()` / `load_trainer_state()`)
    under `<out_dir>/checkpoints`."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.root = Path(trainer.cfg.out_dir) / "checkpoints"

    def state_dict(self) -> dict[str, Any]:
        """The whole training state of a single process (what `state.pt` holds)."""
        t = self.trainer
        return {
            **t.trainer_state(),
            "model": t.model.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in t.optimizers.items()},
        }

    def load_state_dict(self, state: dict[str, Any], path: Path | str = "the checkpoint") -> None:
        t = self.trainer
        ours = {k: tuple(x.shape) for k, x in t.model.state_dict().items()}
        ckpt.shape_mismatch(path, ours, {k: tuple(x.shape) for k, x in state["model"].items()})
        t.model.load_state_dict(state["model"])
        if set(t.optimizers) != set(state["optimizers"]):
            raise ConfigError(f"checkpoint optimizers {sorted(state['optimizers'])} != run's {sorted(t.optimizers)}")
        for k, o in t.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        t.load_trainer_state(state)

    def save(self) -> Path:
        """Checkpoint `step_N`: `state.pt` in a single process, a sharded DCP checkpoint with a process group."""
        t = self.trainer
        meta = {
            "step": t.step,
            "run_config": t.cfg.model_dump(mode="json"),
            "model_config": _model_config_dict(t.model),
            "world_size": t.ctx.world_size,
        }
        keep = t.cfg.checkpoint.keep_last
        if not t.ctx.distributed:
            return ckpt.save(self.root, t.step, self.state_dict(), meta=meta, keep_last=keep)
        import torch.distributed as dist

        from flashnext.parallel import save_state

        path = save_state(ckpt.step_dir(self.root, t.step), t.model, t.optimizers, extra=t.trainer_state())
        if t.ctx.is_main:
            ckpt.commit(self.root, path, meta, keep_last=keep)
        dist.barrier()
        return path

    def load(self, path: Path, state: dict[str, Any] | None = None) -> None:
        """Restore a checkpoint of either format (a sharded one at any world size, including a single process);
        `state`: the single-process `state.pt` already read by `checkpoint.training.read_checkpoint`."""
        t = self.trainer
        if (Path(path) / ckpt.SHARDED_STATE_FILE).exists():
            from flashnext.parallel import load_state

            t.load_trainer_state(load_state(path, t.model, t.optimizers))
        elif t.ctx.distributed:
            raise ConfigError(
                f"{path} is a single-process checkpoint; resume it with one process, or convert it "
                "(flashnext convert) and start from the exported weights"
            )
        else:
            self.load_state_dict(state if state is not None else ckpt.load(path), path)

    def resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` names (`latest`: the newest readable one, if any).

        With `latest`, a checkpoint whose files cannot be read (a truncated `state.pt`, a corrupt `meta.json`) is
        skipped with a warning naming the file and set aside, and the previous one is used: losing the steps
        since it beats losing the run. An explicitly named checkpoint that cannot be read is refused.
        """
        t, where = self.trainer, self.trainer.cfg.checkpoint.resume
        if where is None:
            return None
        if where != "latest":
            path = Path(where)
            self.load(path, ckpt.read_checkpoint(path))
            t.say(f"resumed from {path} at step {t.step}")
            return path
        bad: dict[Path, str] = {}
        for path in reversed(ckpt.list_checkpoints(self.root)):
            try:
                state = ckpt.read_checkpoint(path)
            except CheckpointError as e:
                bad[path] = str(e)
                t.warn(f"{e}; trying the previous checkpoint")
                continue
            self.load(path, state)
            for old in bad if t.ctx.is_main else ():  # out of `latest`'s and keep_last's way, kept for a look
                t.warn(f"set the unreadable checkpoint aside as {ckpt.set_aside(old)}")
            t.say(f"resumed from {path} at step {t.step}" + (f" ({len(bad)} newer unreadable)" if bad else ""))
            return path
        if bad:
            raise CheckpointError(f"resume=latest: no readable checkpoint in {self.root}: " + "; ".join(bad.values()))
        t.say(f"resume=latest: no checkpoint in {self.root}, starting fresh")
        return None


def _model_config_dict(model: torch.nn.Module) -> dict:
    """The config a checkpoint's `meta.json` records: the composite one for a model with a vision tower."""
    composite = getattr(model, "model_config", None)
    if composite is not None and composite.vision_config is not None:
        return composite.to_dict()
    return model.config.to_dict()
