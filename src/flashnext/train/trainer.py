"""The training loop: packed micro-batches, gradient accumulation, SFT or RL loss, checkpoints, metrics.

One optimizer step:
1. take `data.micro_batches` packed micro-batches from the loader (on each rank; with N ranks the loader's
   balancing group is `micro_batches * N` and rank r takes every N-th micro-batch of the step);
2. count the step's loss tokens over every micro-batch (and rank), so each micro-batch loss is a sum divided by the
   step's count and the accumulated gradient is the step mean however the tokens were split;
3. forward + backward each micro-batch, clip the global gradient norm, step every optimizer and the schedule.

Checkpoints (`checkpoint.py`) hold the model, optimizers, schedulers, the loader position and the RNG states, so a
resumed run repeats the uninterrupted run's losses bit for bit on CPU. SIGINT/SIGTERM and a failure inside the
loop save the last completed step first (`interrupt.py`).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashnext.batch import PackedBatch, make_segments, next_token_targets
from flashnext.checkpoint import training as ckpt
from flashnext.config import TextConfig
from flashnext.errors import CheckpointError, ConfigError
from flashnext.parallel.context import ContextBatch, context_group
from flashnext.parallel.dist import DistContext, init_distributed
from flashnext.train import run_dir
from flashnext.train.config import RunConfig
from flashnext.train.data import ModelLimits
from flashnext.train.evaluation import Evaluator
from flashnext.train.interrupt import StopOnSignal, check_stop, keep_work
from flashnext.train.loss import (
    IGNORE_INDEX,
    count_label_tokens,
    count_mtp_tokens,
    rl_loss,
    shifted_sft_loss,
    step_mean,
    token_logprobs,
)
from flashnext.train.metrics import MetricsLogger, ProgressBar, measure_peak_flops
from flashnext.train.optim import Schedulers, build_optimizer, clip_grad_norm, trainable_params
from flashnext.train.packing import PackedLoader, flop_cost
from flashnext.train.precision import MixedPrecision
from flashnext.train.setup import (
    DTYPES,
    all_reduce_sum,
    build_model,
    load_examples,
    load_tokenizer_for,
    needs_tokenizer,
    resolve_device,
)


class Trainer:
    """Builds everything a run needs from a `RunConfig` and runs optimizer steps.

    Args:
        cfg: the run config.
        ctx: rank / world size (a single process by default).
        say: where human-readable progress lines go (rank 0 only).
    """

    def __init__(self, cfg: RunConfig, ctx: DistContext | None = None, say=print):
        self.cfg, self.ctx = cfg, ctx or init_distributed(device="cpu")
        self.say = say if self.ctx.is_main else (lambda *a, **k: None)
        self._seed_threads()
        self.device = self.ctx.device if self.ctx.distributed else resolve_device(cfg.train.device)
        self.out_dir = Path(cfg.out_dir)
        self.model = build_model(cfg, self.device, self.ctx)
        self.text_config: TextConfig = self.model.config
        self.cp = self._context_group()  # None without context parallelism
        self.dp_rank, self.dp_size = (self.cp.index, self.cp.count) if self.cp else (self.ctx.rank, self.ctx.world_size)
        self.tokenizer = load_tokenizer_for(cfg) if needs_tokenizer(cfg) else None
        self._check_vocab()
        self._build_data()
        self._wrap_model()
        self._build_optimizers()
        self.precision = self._mixed_precision()
        self.step = 0
        self.tokens_seen = 0
        self.peak_flops = None

    def _seed_threads(self) -> None:
        """Threads and the torch/python seeds of the run (the data order has its own seed)."""
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        torch.manual_seed(self.cfg.train.seed)
        random.seed(self.cfg.train.seed)

    def _build_data(self) -> None:
        """The examples (checked against the model at load), the packed loader and the held-out evaluator."""
        cfg = self.cfg
        examples, held_out = load_examples(cfg, self.tokenizer, ModelLimits.of(self.text_config))
        self.cost_fn = flop_cost(self.text_config)
        self.loader = PackedLoader(
            examples,
            cfg.data.token_budget,
            self.cost_fn,
            seed=cfg.data.seed,
            group_size=cfg.data.micro_batches * self.dp_size,
            truncate=cfg.data.truncate,
        )
        self.batches = iter(self.loader)
        self.evaluator = (
            Evaluator(held_out, cfg.data.token_budget, self.cost_fn, cfg.data.truncate) if held_out else None
        )
        if cfg.train.mtp_loss_weight > 0 and getattr(self.model, "mtp", None) is None:
            raise ConfigError(
                f"train.mtp_loss_weight={cfg.train.mtp_loss_weight} but the model has no MTP head (its config "
                "declares no MTP layer: set mtp_num_hidden_layers = 1, e.g. via model.overrides)"
            )
        # the held-out split too: its loss is the run's loss
        if cfg.train.loss == "rl" and any(x[0].inference_logprobs is None for x in (examples, held_out or examples)):
            raise ConfigError("train.loss='rl' needs RL records (inference_logprobs, advantages) in the data")

    def _wrap_model(self) -> None:
        """Compile, then activation checkpointing, in one process (`parallelize` applied both under torchrun)."""
        if self.ctx.distributed:
            return
        if self.cfg.train.compile:
            from flashnext.compile import compile_model

            compile_model(self.model)  # before checkpointing: it compiles the plain layers
        if self.cfg.train.activation_checkpointing:
            from flashnext.activation_checkpoint import apply_activation_checkpointing

            apply_activation_checkpointing(self.model)

    def _build_optimizers(self) -> None:
        """Muon / per-expert Muon / AdamW groups (shard-aware under FSDP2) and their schedule."""
        self.optimizers, self.param_groups = build_optimizer(self.model, self.cfg.optim)
        if self.ctx.distributed:
            from flashnext.parallel import shard_aware_optimizers

            shard_aware_optimizers(self.optimizers)  # Muon orthogonalises whole matrices, not FSDP shards
        self.schedulers = Schedulers(self.optimizers, self.cfg.optim)

    def _mixed_precision(self) -> MixedPrecision | None:
        """bf16 compute copies over the fp32 parameters (`train.compute_dtype`), in a single process."""
        cfg = self.cfg
        if cfg.train.compute_dtype == cfg.model.dtype:
            return None  # fp32 throughout, or bf16 parameters throughout
        if self.ctx.distributed:
            if self.device.type == "cuda":
                return None  # FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 sharded masters (`parallelize`)
            raise ConfigError(
                "train.compute_dtype='bfloat16' with fp32 parameters is not supported under torchrun on CPU "
                "(FSDP2's bf16 policy is enabled on CUDA only); use model.dtype='bfloat16' or compute in float32"
            )
        return MixedPrecision(self.model, DTYPES[cfg.train.compute_dtype])

    def _compute(self):
        """The context forward and backward run in: bf16 compute copies under mixed precision, else nothing."""
        return self.precision.compute() if self.precision is not None else contextlib.nullcontext()

    def warn(self, message: str) -> None:
        """A warning line on stderr (rank 0 only)."""
        if self.ctx.is_main:
            print(f"flashnext train: warning: {message}", file=sys.stderr, flush=True)

    def _context_group(self):
        """`parallel.cp > 1`: this rank's CP group (`parallel.context`); its ranks split each micro-batch."""
        cp = self.cfg.parallel.cp
        if cp == 1:
            return None
        from flashnext.model.text import FlashNextForCausalLM

        if not self.ctx.distributed or self.cfg.train.compile or not isinstance(self.model, FlashNextForCausalLM):
            raise ConfigError(f"parallel.cp={cp} needs a torchrun launch, a text model and train.compile=false")
        if self.cfg.train.mtp_loss_weight > 0:
            raise ConfigError(
                f"parallel.cp={cp} with train.mtp_loss_weight > 0 is not supported (the MTP head's targets "
                "are two tokens ahead, across the slice's edge)"
            )

        ratio = self.text_config.indexer_compress_ratio if self.text_config.qsa_enabled else 1
        return context_group(self.ctx.rank, self.ctx.world_size, cp, ratio)

    def _check_vocab(self) -> None:
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.text_config.vocab_size:
            raise ConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{self.text_config.vocab_size}"
            )

    # ---- one step --------------------------------------------------------------------------------------
    def next_micro_batches(self) -> list[PackedBatch]:
        """This rank's micro-batches of the next step (the loader position advances for every rank's share).

        With context parallelism the ranks of a CP group take the same micro-batches, each its slice of them."""
        n, groups = self.cfg.data.micro_batches, self.dp_size
        step_batches = [next(self.batches) for _ in range(n * groups)]
        mine = step_batches[self.dp_rank :: groups]
        return [self.cp.shard(b, self.device) for b in mine] if self.cp else mine

    def _forward_loss(
        self, b: PackedBatch | ContextBatch, num_loss_tokens: float, num_mtp_tokens: float = 0.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """(loss, RL metrics, the MTP head's loss or None when `train.mtp_loss_weight` is 0) of one micro-batch.

        The model computes the losses or the target log-probs without materialising the [T, V] logits
        (`return_logits=False`: the LM heads run in row chunks fused with the loss, `ops.lm_head`).
        """
        if isinstance(b, ContextBatch):  # (context parallelism is refused with an MTP loss: `_context_group`)
            return (*self._context_forward_loss(b, num_loss_tokens), None)
        dev = self.device
        ids, cu, pos = b.input_ids.to(dev), b.cu_seqlens, b.position_ids.to(dev)
        replay = b.routed_experts.to(dev) if b.routed_experts is not None else None
        labels = b.labels.to(dev)
        with_mtp = self.cfg.train.mtp_loss_weight > 0
        kwargs = dict(cu_seqlens=cu, position_ids=pos, routed_experts=replay, return_logits=False)
        kwargs.update(b.image_kwargs(dev), **({"return_mtp": True} if with_mtp else {}))
        if self.cfg.train.loss == "sft":
            out = self.model(ids, labels=labels, **kwargs)
            return step_mean(out.loss_sum, num_loss_tokens), {}, self._mtp_loss(out, num_mtp_tokens)
        seg = make_segments(cu, ids.shape[0], pos, device=dev)
        targets = next_token_targets(labels, seg, IGNORE_INDEX)
        mask = targets != IGNORE_INDEX
        # labels only for the MTP head's targets (the main head then also sums a CE nobody reads: one chunked pass)
        mtp_labels = {"labels": labels} if with_mtp else {}
        lp_infer = next_token_targets(b.inference_logprobs.to(dev), seg, 0.0)  # aligned with the prediction at t
        adv = next_token_targets(b.advantages.to(dev), seg, 0.0)
        if self.cfg.rl.temperature != 1.0:  # the chunked head's log-probs are T = 1's: these go through the logits
            out = self.model(ids, **mtp_labels, **{**kwargs, "return_logits": True})
            loss, metrics = self._rl_loss(out.logits, targets, lp_infer, adv, num_loss_tokens)
            return loss, metrics, self._mtp_loss(out, num_mtp_tokens)
        out = self.model(ids, logprob_targets=torch.where(mask, targets, 0), **mtp_labels, **kwargs)
        loss, metrics = rl_loss(out.logprobs, lp_infer, adv, mask, num_loss_tokens, self.cfg.rl, entropy=out.entropy)
        return loss, metrics, self._mtp_loss(out, num_mtp_tokens)

    def _mtp_loss(self, out, num_mtp_tokens: float) -> torch.Tensor | None:
        if self.cfg.train.mtp_loss_weight <= 0:
            return None
        return step_mean(out.mtp_loss_sum, num_mtp_tokens, "num_mtp_tokens")

    def _context_forward_loss(self, b: ContextBatch, num_loss_tokens: float):
        """A CP rank's slice: targets (and RL inputs) were shifted on the whole stream before slicing."""
        ids, cu, pos, replay = b.input_ids, b.cu_seqlens, b.position_ids, b.routed_experts
        out = self.model(ids, cu_seqlens=cu, position_ids=pos, routed_experts=replay, cp=b.shard)
        if self.cfg.train.loss == "sft":
            return shifted_sft_loss(out.logits, b.targets, num_loss_tokens), {}
        return self._rl_loss(out.logits, b.targets, b.inference_logprobs, b.advantages, num_loss_tokens)

    def _rl_loss(self, logits, targets, lp_infer, adv, num_loss_tokens: float):
        mask = targets != IGNORE_INDEX
        lp_train, entropy = token_logprobs(logits, torch.where(mask, targets, 0), self.cfg.rl.temperature)
        return rl_loss(lp_train, lp_infer, adv, mask, num_loss_tokens, self.cfg.rl, entropy=entropy)

    def _counts(self, b: PackedBatch | ContextBatch) -> tuple[int, int, float, int]:
        """(loss tokens, input tokens, forward FLOPs, MTP targets) of this rank's part of a micro-batch: summed over
        ranks they count every micro-batch of the step once (a CP rank counts its slice, and 1/cp of the FLOPs)."""
        if isinstance(b, ContextBatch):
            share = self.cost_fn(b.source.lengths) / self.cp.size
            return int((b.targets != IGNORE_INDEX).sum()), b.real_tokens, share, 0
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

    # ---- checkpoints --------------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        """Everything but the model and optimizer tensors: step, schedule, data position, RNG states."""
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "schedulers": self.schedulers.state_dict(),
            "data": self.loader.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.schedulers.load_state_dict(state["schedulers"])
        self.loader.load_state_dict(state["data"])
        self.batches = iter(self.loader)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def state_dict(self) -> dict[str, Any]:
        """The whole training state of a single process (what `state.pt` holds)."""
        return {
            **self.trainer_state(),
            "model": self.model.state_dict(),
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
        }

    def load_state_dict(self, state: dict[str, Any], path: Path | str = "the checkpoint") -> None:
        ours = {k: tuple(t.shape) for k, t in self.model.state_dict().items()}
        ckpt.shape_mismatch(path, ours, {k: tuple(t.shape) for k, t in state["model"].items()})
        self.model.load_state_dict(state["model"])
        if set(self.optimizers) != set(state["optimizers"]):
            raise ConfigError(f"checkpoint optimizers {sorted(state['optimizers'])} != run's {sorted(self.optimizers)}")
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        self.load_trainer_state(state)

    def save_checkpoint(self) -> Path:
        """Checkpoint `step_N`: `state.pt` in a single process, a sharded DCP checkpoint with a process group."""
        root = self.out_dir / "checkpoints"
        meta = {
            "step": self.step,
            "run_config": self.cfg.model_dump(mode="json"),
            "model_config": _model_config_dict(self.model),
            "world_size": self.ctx.world_size,
        }
        keep = self.cfg.checkpoint.keep_last
        if not self.ctx.distributed:
            return ckpt.save(root, self.step, self.state_dict(), meta=meta, keep_last=keep)
        import torch.distributed as dist

        from flashnext.parallel import save_state

        path = save_state(ckpt.step_dir(root, self.step), self.model, self.optimizers, extra=self.trainer_state())
        if self.ctx.is_main:
            ckpt.commit(root, path, meta, keep_last=keep)
        dist.barrier()
        return path

    def load_checkpoint(self, path: Path, state: dict[str, Any] | None = None) -> None:
        """Restore a checkpoint of either format (a sharded one at any world size, including a single process);
        `state`: the single-process `state.pt` already read by `checkpoint.training.read_checkpoint`."""
        if (Path(path) / ckpt.SHARDED_STATE_FILE).exists():
            from flashnext.parallel import load_state

            self.load_trainer_state(load_state(path, self.model, self.optimizers))
        elif self.ctx.distributed:
            raise ConfigError(
                f"{path} is a single-process checkpoint; resume it with one process, or convert it "
                "(flashnext convert) and start from the exported weights"
            )
        else:
            self.load_state_dict(state if state is not None else ckpt.load(path), path)

    def maybe_resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` names (`latest`: the newest readable one, if any).

        With `latest`, a checkpoint whose files cannot be read (a truncated `state.pt`, a corrupt `meta.json`) is
        skipped with a warning naming the file and set aside, and the previous one is used: losing the steps
        since it beats losing the run. An explicitly named checkpoint that cannot be read is refused.
        """
        where = self.cfg.checkpoint.resume
        if where is None:
            return None
        if where != "latest":
            path = Path(where)
            self.load_checkpoint(path, ckpt.read_checkpoint(path))
            self.say(f"resumed from {path} at step {self.step}")
            return path
        root = self.out_dir / "checkpoints"
        bad: dict[Path, str] = {}
        for path in reversed(ckpt.list_checkpoints(root)):
            try:
                state = ckpt.read_checkpoint(path)
            except CheckpointError as e:
                bad[path] = str(e)
                self.warn(f"{e}; trying the previous checkpoint")
                continue
            self.load_checkpoint(path, state)
            for old in bad if self.ctx.is_main else ():  # out of `latest`'s and keep_last's way, kept for a look
                self.warn(f"set the unreadable checkpoint aside as {ckpt.set_aside(old)}")
            self.say(f"resumed from {path} at step {self.step}" + (f" ({len(bad)} newer unreadable)" if bad else ""))
            return path
        if bad:
            raise CheckpointError(f"resume=latest: no readable checkpoint in {root}: " + "; ".join(bad.values()))
        self.say(f"resume=latest: no checkpoint in {root}, starting fresh")
        return None

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        """Train to `train.steps`, logging and checkpointing; returns the metrics of the steps run here."""
        cfg = self.cfg
        self._claim_out_dir()
        self.maybe_resume()
        if self.step >= cfg.train.steps:
            self.say(
                f"run already finished at step {self.step} (train.steps={cfg.train.steps}); "
                "raise --train.steps to continue"
            )
            return []
        self._announce()
        history = keep_work(self, self._loop)
        if history:
            t0 = time.perf_counter()
            path = self.save_checkpoint()
            self.say(f"checkpoint: {path} ({time.perf_counter() - t0:.1f}s)")
        if cfg.checkpoint.export:
            final = self.out_dir / "final"
            self.export(final)
            self.say(f"exported the model in the official layout to {final}")
        if history:
            first, last = history[0], history[-1]
            self.say(
                f"done: step {last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
                f"{sum(m['tokens'] for m in history)} tokens, mean {_mean(history, 'tokens_per_s'):,.0f} tokens/s"
                + (f", MFU {_mean(history, 'mfu'):.2%}" if "mfu" in last else "")
                + (f", eval loss {last['eval_loss']:.4f}" if "eval_loss" in last else "")
            )
        return history

    def _claim_out_dir(self) -> None:
        """Refuse a previous run in `out_dir` (unless resuming), or clear it with `train.overwrite` (rank 0)."""
        cfg = self.cfg
        if self.ctx.is_main:
            run_dir.check_out_dir(self.out_dir, cfg.checkpoint.resume, cfg.train.overwrite)
            if cfg.train.overwrite:
                gone = run_dir.clear_run(self.out_dir)
                if gone:
                    self.say(f"overwrite: deleted the previous run's {', '.join(gone)} in {self.out_dir}")
        if self.ctx.distributed:
            import torch.distributed as dist

            dist.barrier()  # nobody writes before rank 0 has checked and cleared

    def _announce(self) -> None:
        cfg = self.cfg
        if cfg.log.peak_flops == "measure":  # the GEMM rate of the dtype the matmuls run in
            self.peak_flops = measure_peak_flops(self.device, DTYPES[cfg.train.compute_dtype])
        else:
            self.peak_flops = float(cfg.log.peak_flops)
        held_out = f", {self.evaluator.num_examples} held out" if self.evaluator else ""
        self.say(
            f"model: {_params_text(self.model, self.ctx)} on {self.device} ({_precision(cfg)}); "
            f"{len(self.loader.examples)} examples{held_out}, token budget {cfg.data.token_budget} x "
            f"{cfg.data.micro_batches} micro-batches x {self.ctx.world_size} rank(s); "
            f"peak {self.peak_flops / 1e9:.1f} GFLOP/s per device; steps {self.step} -> {cfg.train.steps}"
        )

    def _loop(self, stop: StopOnSignal) -> list[dict[str, float]]:
        """The steps from the current one to `train.steps`: train, evaluate, log, checkpoint; between steps, stop
        (with a checkpoint) when `stop` was signalled (`train/interrupt.py`)."""
        cfg = self.cfg
        logger = MetricsLogger(
            self.out_dir / "metrics.jsonl", enabled=self.ctx.is_main, resume_step=self.step, wandb=cfg.log.wandb_project
        )
        bar = ProgressBar(cfg.train.steps, self.step, enabled=cfg.log.progress and self.ctx.is_main)
        history = []
        try:
            while self.step < cfg.train.steps:
                check_stop(self, stop)
                metrics = self.train_step(self.next_micro_batches())
                last = self.step == cfg.train.steps
                if self.evaluator is not None and (last or _every(self.step, cfg.train.eval_every)):
                    metrics["eval_loss"] = self.eval_loss()
                history.append(metrics)
                bar.update(metrics)
                if self.step % cfg.log.every == 0 or last or "eval_loss" in metrics:
                    logger.log(metrics)
                if _every(self.step, cfg.checkpoint.every) and not last:
                    t0 = time.perf_counter()
                    path = self.save_checkpoint()
                    bar.write(f"checkpoint: {path} ({time.perf_counter() - t0:.1f}s)", self.say)
        finally:
            bar.close()
            logger.close()
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
        """The current weights in the official Hugging Face layout (+ the tokenizer files); collective.

        The export is written to a temp directory beside `path`, which then replaces `path` whole (no file of an
        older export survives beside the new one). With a process group every rank writes what it owns (n-gram
        table shards) and rank 0 the rest.
        """
        path = Path(path)
        tmp = run_dir.export_dir(path, clear=self.ctx.is_main)
        if self.ctx.distributed:
            import torch.distributed as dist

            from flashnext.parallel import export_pretrained

            dist.barrier()  # rank 0 emptied the temp directory
            export_pretrained(self.model, tmp)
        else:
            self.model.save_pretrained(tmp)
        if self.ctx.is_main:
            if self.tokenizer is not None and hasattr(self.tokenizer, "save"):
                self.tokenizer.save(tmp)
            run_dir.swap_in(tmp, path)


def _params_text(model, ctx: DistContext) -> str:
    """The whole model's parameter count, the same under torchrun as in one process (FSDP2 shards and owner-routed
    tables count their full shapes), and under torchrun rank 0's share of it."""
    if not ctx.distributed:
        return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params"
    from flashnext.parallel import parameter_counts

    total, local = parameter_counts(model)
    return f"{total / 1e6:.2f}M params ({local / 1e6:.2f}M held by rank 0 of {ctx.world_size})"


def _precision(cfg: RunConfig) -> str:
    if cfg.train.compute_dtype == cfg.model.dtype:
        return cfg.model.dtype
    return f"{cfg.train.compute_dtype} compute, {cfg.model.dtype} master weights"


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _metric_weight(name: str, metrics: dict[str, torch.Tensor]) -> float:
    """The tokens a micro-batch's RL metric averages over (masked / unmasked loss tokens, or all of them), so the
    weighted step means do not depend on how the step's tokens were split into micro-batches and CP slices."""
    loss_tokens, masked = float(metrics["loss_tokens"]), float(metrics["masked_tokens"])
    if name.endswith("_unmasked"):
        return loss_tokens - masked
    return masked if name.endswith("_masked") else loss_tokens


def _mean(history: list[dict[str, float]], key: str) -> float:
    values = [m[key] for m in history if key in m]
    return sum(values) / max(len(values), 1)


def _model_config_dict(model: torch.nn.Module) -> dict:
    """The config a checkpoint's `meta.json` records: the composite one for a model with a vision tower."""
    composite = getattr(model, "model_config", None)
    if composite is not None and composite.vision_config is not None:
        return composite.to_dict()
    return model.config.to_dict()
