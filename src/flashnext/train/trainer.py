"""The trainer: the model, its optimizers and one optimizer step; checkpoints, resume and export.

One optimizer step (`Trainer.train_step`) over this rank's micro-batches of the step:
1. count the step's loss tokens over every micro-batch (and rank), so each micro-batch loss is a sum divided by the
   step's count and the accumulated gradient is the step mean however the tokens were split;
2. forward + backward each micro-batch through the run's `Objective` (`objective.py`: SFT or RL, + MTP), clip the
   global gradient norm, step every optimizer and the schedule.
The steps run in `loop.train_loop`, fed by the run's `Workload` (`loop.py`): the packed data file by default
(`sft.py`), or RL rollouts (`rl/loop.py`). Checkpoints (`checkpoint.py`) hold the model, optimizers, schedulers,
the batch source's position and the RNG states, so a resumed run repeats the uninterrupted run's losses bit for bit
on CPU. SIGINT/SIGTERM and a failure inside the loop save the last completed step first (`interrupt.py`).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashnext.batch import PackedBatch
from flashnext.config import TextConfig
from flashnext.parallel.context import ContextBatch
from flashnext.parallel.dist import DistContext, init_distributed
from flashnext.train import run_dir
from flashnext.train.checkpointing import Checkpointer
from flashnext.train.config import RunConfig
from flashnext.train.evaluation import Evaluator
from flashnext.train.interrupt import keep_work
from flashnext.train.loop import Workload, train_loop
from flashnext.train.loss import IGNORE_INDEX, count_label_tokens, count_mtp_tokens
from flashnext.train.objective import build_objective
from flashnext.train.optim import clip_grad_norm, trainable_params
from flashnext.train.packing import PackedLoader, flop_cost
from flashnext.train.setup import (
    all_reduce_sum,
    build_model,
    build_optimizers,
    check_vocab,
    context_group_of,
    load_tokenizer_for,
    mixed_precision,
    needs_tokenizer,
    resolve_device,
    seed_threads,
    wrap_model,
)
from flashnext.train.sft import SFTWorkload, load_data


class Trainer:
    """Builds the model, optimizers and the run's workload from a `RunConfig` and runs optimizer steps.

    Args:
        cfg: the run config.
        ctx: rank / world size (a single process by default).
        say: where human-readable progress lines go (rank 0 only).
        workload: builds the run's batch source and hooks from the trainer (`loop.Workload`; e.g. RL rollouts,
            `rl.loop.rl_trainer`); by default the data file's packed micro-batches (`sft.SFTWorkload`).
    """

    def __init__(self, cfg: RunConfig, ctx: DistContext | None = None, say=print,
                 workload: Callable[[Trainer], Workload] | None = None):  # fmt: skip
        self.cfg, self.ctx = cfg, ctx or init_distributed(device="cpu")
        self.say = say if self.ctx.is_main else (lambda *a, **k: None)
        seed_threads(cfg)
        self.device = self.ctx.device if self.ctx.distributed else resolve_device(cfg.train.device)
        self.out_dir = Path(cfg.out_dir)
        self.model = build_model(cfg, self.device, self.ctx)
        self.text_config: TextConfig = self.model.config
        self.cp = context_group_of(cfg, self.ctx, self.model)  # None without context parallelism
        self.dp_rank, self.dp_size = (self.cp.index, self.cp.count) if self.cp else (self.ctx.rank, self.ctx.world_size)
        self.tokenizer = load_tokenizer_for(cfg) if needs_tokenizer(cfg) else None
        check_vocab(self.tokenizer, self.text_config)
        self.cost_fn = flop_cost(self.text_config)
        self.loader: PackedLoader | None = None  # the data file's (None when another workload feeds the run)
        self.evaluator: Evaluator | None = None
        if workload is None:
            self.loader, self.evaluator = load_data(cfg, self.tokenizer, self.model, self.cost_fn, self.dp_size)
        self.objective = build_objective(cfg, self.device)
        if not self.ctx.distributed:  # (under torchrun `parallelize` applied both)
            wrap_model(self.model, cfg)
        self.optimizers, self.param_groups, self.schedulers = build_optimizers(self.model, cfg, self.ctx)
        self.precision = mixed_precision(self.model, cfg, self.ctx, self.device)
        self.checkpoints = Checkpointer(self)
        self.step = 0
        self.tokens_seen = 0
        self.peak_flops = None
        self.workload: Workload = (workload or SFTWorkload)(self)

    def _compute(self):
        """The context forward and backward run in: bf16 compute copies under mixed precision, else nothing."""
        return self.precision.compute() if self.precision is not None else contextlib.nullcontext()

    def warn(self, message: str) -> None:
        """A warning line on stderr (rank 0 only)."""
        if self.ctx.is_main:
            print(f"flashnext train: warning: {message}", file=sys.stderr, flush=True)

    # ---- one step --------------------------------------------------------------------------------------
    def next_micro_batches(self) -> list[PackedBatch | ContextBatch]:
        """This rank's micro-batches of the next step, from the workload's batch source."""
        return self.workload.source.next_step(self.step)

    def _forward_loss(self, b: PackedBatch | ContextBatch, num_loss_tokens: float, num_mtp_tokens: float = 0.0):
        """(loss, RL metrics, the MTP head's loss or None) of one micro-batch: the run's `Objective`."""
        return self.objective(self.model, b, num_loss_tokens, num_mtp_tokens)

    def _counts(self, b: PackedBatch | ContextBatch) -> tuple[int, int, float, int]:
        """(loss tokens, input tokens, forward FLOPs, MTP targets) of this rank's part of a micro-batch: summed over
        ranks they count every micro-batch of the step once (a CP rank counts its slice, and 1/cp of the FLOPs)."""
        if isinstance(b, ContextBatch):
            share = self.cost_fn(b.source.lengths) / self.cp.size
            mtp = b.num_mtp_targets if self.cfg.train.mtp_loss_weight else 0
            return int((b.targets != IGNORE_INDEX).sum()), b.real_tokens, share, mtp
        mtp = count_mtp_tokens(b.labels, b.cu_seqlens) if self.cfg.train.mtp_loss_weight else 0
        return count_label_tokens(b.labels, b.cu_seqlens), b.num_tokens, self.cost_fn(b.lengths), mtp

    def _accumulate(self, batches: list, num_loss_tokens: float, num_mtp_tokens: float):
        """Forward/backward every micro-batch; (loss sum, MTP loss sum, RL metric [weighted sum, weight] by name)."""
        loss_sum, mtp_sum = torch.zeros((), dtype=torch.float64), 0.0
        rl_sums: dict[str, list[float]] = {}
        weight = self.cfg.train.mtp_loss_weight
        sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2 root after `parallelize`
        for i, b in enumerate(batches):
            if sync is not None:  # reduce-scatter once per step: the last micro-batch's backward syncs the sum
                sync(i == len(batches) - 1)
            loss, metrics, mtp = self._forward_loss(b, num_loss_tokens, num_mtp_tokens)
            (loss if mtp is None else loss + weight * mtp).backward()
            loss_sum += loss.detach().double().cpu()
            mtp_sum += 0.0 if mtp is None else float(mtp.detach())
            for k, v in metrics.items():  # micro-batch means over some of its loss tokens -> weighted sums
                if not k.endswith("_tokens"):
                    w = _metric_weight(k, metrics)
                    acc = rl_sums.setdefault(k, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + float(v) * w, acc[1] + w
        return loss_sum, mtp_sum, rl_sums

    def train_step(self, batches: list[PackedBatch]) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step the optimizers and the schedule; returns metrics."""
        t0 = time.perf_counter()
        counts = [self._counts(b) for b in batches]
        local = [float(sum(c[j] for c in counts)) for j in (0, 1, 3)]
        num_loss_tokens, tokens, num_mtp_tokens = all_reduce_sum(self.ctx, local)
        with self._compute():  # fp32 parameters and gradients again after it (mixed precision)
            loss_sum, mtp_sum, rl_sums = self._accumulate(batches, num_loss_tokens, num_mtp_tokens)
        t_backward = time.perf_counter()
        (loss_total,) = all_reduce_sum(self.ctx, [float(loss_sum)])
        if not math.isfinite(loss_total):  # before the update: the weights (and a checkpoint of them) stay sane
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"step {self.step + 1}: loss is {loss_total} (the weights were not updated)")
        grad_norm, lrs = self._update()
        self.step += 1
        self.tokens_seen += int(tokens)

        seconds = time.perf_counter() - t0
        flops = 3.0 * sum(c[2] for c in counts)  # forward + backward (2x), no recompute
        (flops,) = all_reduce_sum(self.ctx, [flops])
        out = {
            "step": self.step,
            "loss": loss_total,
            "grad_norm": float(grad_norm),
            "lr": lrs.get("adamw", next(iter(lrs.values()))),
            "lr_muon": lrs.get("muon", float("nan")),
            "tokens": int(tokens),
            "loss_tokens": int(num_loss_tokens),
            "tokens_seen": self.tokens_seen,
            "seconds": seconds,
            "seconds_fwd_bwd": t_backward - t0,
            "seconds_optim": time.perf_counter() - t_backward,
            "tokens_per_s": tokens / seconds,
            "model_flops_per_s": flops / seconds,
        }
        if self.cfg.train.mtp_loss_weight:  # the head's own loss (mean over the step's MTP targets)
            (out["mtp_loss"],) = all_reduce_sum(self.ctx, [mtp_sum])
        if self.peak_flops:
            out["mfu"] = flops / seconds / (self.peak_flops * self.ctx.world_size)
        if rl_sums:  # means over the whole step's tokens of each kind: every micro-batch (or CP slice) of every rank
            keys = sorted(rl_sums)
            sums = all_reduce_sum(self.ctx, [x for k in keys for x in rl_sums[k]])
            out.update({f"rl/{k}": sums[2 * i] / max(sums[2 * i + 1], 1.0) for i, k in enumerate(keys)})
        return out

    def _update(self) -> tuple[torch.Tensor, dict[str, float]]:
        """Clip the global gradient norm, step every optimizer and the schedule; (the norm, the step's lrs)."""
        params = trainable_params(self.optimizers)
        if self.ctx.distributed:
            from flashnext.parallel import clip_grad_norm_distributed

            grad_norm = clip_grad_norm_distributed(params, self.cfg.optim.max_grad_norm)
        else:
            grad_norm = clip_grad_norm(params, self.cfg.optim.max_grad_norm)
        for opt in self.optimizers.values():
            opt.step()
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        lrs = self.schedulers.last_lrs()
        self.schedulers.step()
        return grad_norm, lrs

    # ---- checkpoints --------------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Everything but the model and optimizer tensors: step, schedule, batch source position, RNG states."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "schedulers": self.schedulers.state_dict(),
            **self.workload.source.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.schedulers.load_state_dict(state["schedulers"])
        self.workload.source.load_state_dict(state)
        torch.set_rng_state(state["rng"]["torch"])
        if "python" in state["rng"]:  # (RL checkpoints before the one loop kept the torch RNG only)
            random.setstate(state["rng"]["python"])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def save_checkpoint(self) -> Path:
        """Checkpoint `step_N` (`checkpointing.Checkpointer.save`)."""
        return self.checkpoints.save()

    def load_checkpoint(self, path: Path, state: dict[str, Any] | None = None) -> None:
        """Restore a checkpoint of either format (`checkpointing.Checkpointer.load`)."""
        self.checkpoints.load(path, state)

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        """Train to `train.steps` (`loop.train_loop` with the workload's source and hooks), then save, export and
        summarise; returns the metrics of the steps run here."""
        cfg, work = self.cfg, self.workload
        run_dir.claim(self.out_dir, cfg.checkpoint.resume, cfg.train.overwrite, self.ctx, self.say)
        self.checkpoints.resume()
        if self.step >= cfg.train.steps:
            self.say(
                f"run already finished at step {self.step} (train.steps={cfg.train.steps}); "
                "raise --train.steps to continue"
            )
            return []
        try:
            work.announce()
            hooks = work.hooks()
            history = keep_work(self, lambda stop: train_loop(self, work.source, hooks, stop))
            t0 = time.perf_counter()
            path = self.save_checkpoint()
            self.say(f"checkpoint: {path} ({time.perf_counter() - t0:.1f}s)")
        finally:
            work.source.close()
        if cfg.checkpoint.export:
            final = self.out_dir / "final"
            self.export(final)
            self.say(f"exported the model in the official layout to {final}")
        summary = work.summary(history)
        if summary:
            self.say(summary)
        return history

    def eval_loss(self) -> float:
        """The held-out loss (mean per loss token over the whole split, the run's loss, no gradient); collective."""
        with self._compute():  # in the run's compute dtype
            return self.evaluator.loss(
                self.model,
                self._forward_loss,
                self.ctx.rank,
                self.ctx.world_size,
                lambda values: all_reduce_sum(self.ctx, values),
            )

    def export(self, path: Path) -> None:
        """The current weights in the official Hugging Face layout (+ the tokenizer files) at `path`; collective
        (`run_dir.export_model`)."""
        run_dir.export_model(self.model, self.tokenizer, self.ctx, path)


def _metric_weight(name: str, metrics: dict[str, torch.Tensor]) -> float:
    """The tokens a micro-batch's RL metric averages over (masked / unmasked loss tokens, or all of them), so the
    weighted step means do not depend on how the step's tokens were split into micro-batches and CP slices."""
    loss_tokens, masked = float(metrics["loss_tokens"]), float(metrics["masked_tokens"])
    if name.endswith("_unmasked"):
        return loss_tokens - masked
    return masked if name.endswith("_masked") else loss_tokens
