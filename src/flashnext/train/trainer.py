"""The training loop: packed micro-batches, gradient accumulation, SFT or RL loss, checkpoints, metrics.

One optimizer step:
1. take `data.micro_batches` packed micro-batches from the loader (on each rank; with N ranks the loader's
   balancing group is `micro_batches * N` and rank r takes every N-th micro-batch of the step);
2. count the step's loss tokens over every micro-batch (and rank), so each micro-batch loss is a sum divided by the
   step's count and the accumulated gradient is the step mean however the tokens were split;
3. forward + backward each micro-batch, clip the global gradient norm, step every optimizer and the schedule.

Checkpoints (`checkpoint.py`) hold the model, optimizers, schedulers, the loader position and the RNG states, so a
resumed run repeats the uninterrupted run's losses bit for bit on CPU.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashnext.batch import PackedBatch, make_segments, next_token_targets
from flashnext.config import TextConfig, load_config, parse_config, tiny_config_dict
from flashnext.errors import CheckpointError, ConfigError, InputError
from flashnext.parallel.dist import DistContext, init_distributed
from flashnext.train import run_dir
from flashnext.train import state_io as ckpt
from flashnext.train.config import RunConfig
from flashnext.train.data import Example, ModelLimits, load_jsonl
from flashnext.train.evaluation import Evaluator, split_eval
from flashnext.train.loss import IGNORE_INDEX, count_label_tokens, rl_loss, sft_loss, token_logprobs
from flashnext.train.metrics import MetricsLogger, ProgressBar, measure_peak_flops
from flashnext.train.optim import Schedulers, build_optimizer, clip_grad_norm, trainable_params
from flashnext.train.packing import PackedLoader, flop_cost

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def all_reduce_sum(ctx: DistContext, values: list[float]) -> list[float]:
    """Sum host numbers over ranks (identity in a single process)."""
    if not ctx.distributed:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available")
    return dev


def model_text_config(cfg: RunConfig) -> TextConfig:
    """The text config the run builds (from the checkpoint, the named config, or the embedded tiny default)."""
    section = cfg.model
    if section.path is not None:
        return load_config(section.path).text
    if section.config == "tiny":
        raw = tiny_config_dict()
    else:
        raw = load_config(section.config).to_dict() if Path(section.config).exists() else None
        if raw is None:
            raise ConfigError(f"model.config={section.config!r} is neither 'tiny' nor an existing path")
    if "text_config" in raw:
        raw = raw["text_config"]
    unknown = sorted(set(section.overrides) - set(TextConfig.__dataclass_fields__) - set(raw))
    if unknown:
        raise ConfigError(f"model.overrides: unknown config field(s) {unknown}")
    return parse_config({**raw, **section.overrides}).text


def build_model(cfg: RunConfig, device: torch.device, ctx: DistContext | None = None) -> torch.nn.Module:
    """The model of a run: loaded from `model.path`, or built and randomly initialised from `model.seed`.

    With a process group the model is handed to `parallelize` (owner-routed n-gram tables, activation
    checkpointing, compile, FSDP2): a random init is built on `meta` and only local shards are materialised.
    """
    from flashnext import build

    dtype = _DTYPES[cfg.model.dtype]
    distributed = ctx is not None and ctx.distributed
    if cfg.model.path is not None:
        storage = cfg.model.ngram_storage
        if storage == "auto":  # frozen: as stored (FP8 stays FP8); trainable: in `dtype`, FP8 upcast per shard
            storage = "stored" if cfg.model.freeze_ngram else "dense"
        model = build.from_pretrained(
            cfg.model.path, dtype=dtype, device="cpu" if distributed else device, ngram_storage=storage,
            ngram_resident_mb=cfg.model.ngram_resident_mb,
        )  # fmt: skip
    else:  # distributed: on meta, materialised shard by shard by parallelize
        text = model_text_config(cfg)
        model = build.build_model(text, seed=cfg.model.seed, dtype=dtype, device="meta" if distributed else device)
    if distributed:
        from flashnext.parallel import ParallelConfig, parallelize

        pcfg = ParallelConfig(
            ac=cfg.train.activation_checkpointing,
            compile=cfg.train.compile,
            seed=None if cfg.model.path is not None else cfg.model.seed,
        )
        model = parallelize(model, ctx.mesh, pcfg)
    if cfg.model.freeze_ngram:
        freeze_ngram_tables(model)
    return model.train()


def freeze_ngram_tables(model: torch.nn.Module) -> list[str]:
    """`requires_grad_(False)` on every n-gram table parameter (stored-dtype and on-disk tables have none); returns
    their names. `build_optimizer` then reports them `frozen` and gives them no optimizer state."""
    names = [n for n, p in model.named_parameters() if ".ngram_embedding." in n]
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return names


def load_tokenizer_for(cfg: RunConfig):
    """The run's tokenizer: `model.tokenizer`, else the checkpoint's files, else the bundled tiny tokenizer."""
    from flashnext.tokenizer import load_tokenizer

    if cfg.model.tokenizer is not None:
        return load_tokenizer(cfg.model.tokenizer)
    if cfg.model.path is not None and (Path(cfg.model.path) / "tokenizer.json").exists():
        return load_tokenizer(cfg.model.path)
    return load_tokenizer(None)


def load_examples(
    cfg: RunConfig, tokenizer, limits: ModelLimits | None = None
) -> tuple[list[Example], list[Example] | None]:
    """(training examples, held-out examples or None) as `data` says; every id checked against `limits`."""
    if cfg.data.path is not None:
        path = Path(cfg.data.path)
    else:
        from flashnext.tokenizer import bundled_sft_path

        path = bundled_sft_path()
    examples = _read_examples(path, "data.path", cfg, tokenizer, limits)
    if cfg.data.eval_path is not None:
        return examples, _read_examples(Path(cfg.data.eval_path), "data.eval_path", cfg, tokenizer, limits)
    if cfg.data.eval_fraction:
        return split_eval(examples, cfg.data.eval_fraction, cfg.data.seed)
    return examples, None


def _read_examples(path: Path, field: str, cfg: RunConfig, tokenizer, limits: ModelLimits | None) -> list[Example]:
    if not path.is_file():
        problem = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
        raise ConfigError(f"{field}={str(path)!r} {problem}")
    examples = load_jsonl(path, tokenizer, add_eos=cfg.data.add_eos, limits=limits)
    if not examples:
        raise InputError(f"{path}: no examples")
    return examples


def needs_tokenizer(cfg: RunConfig) -> bool:
    """Pre-tokenized data needs no tokenizer; text data (in `data.path` or `data.eval_path`) and the bundled
    corpus do."""
    if cfg.data.path is None:
        return True
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                line = next((raw for raw in f if raw.strip()), None)
            if line is not None and "input_ids" not in json.loads(line):
                return True
        except (OSError, ValueError, TypeError):
            return True  # let the loader report the file or line
    return False


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
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        torch.manual_seed(cfg.train.seed)
        random.seed(cfg.train.seed)
        self.device = self.ctx.device if self.ctx.distributed else resolve_device(cfg.train.device)
        self.out_dir = Path(cfg.out_dir)

        self.model = build_model(cfg, self.device, self.ctx)
        self.text_config: TextConfig = self.model.config
        self.tokenizer = load_tokenizer_for(cfg) if needs_tokenizer(cfg) else None
        self._check_vocab()
        examples, held_out = load_examples(cfg, self.tokenizer, ModelLimits.of(self.text_config))
        self.cost_fn = flop_cost(self.text_config)
        self.loader = PackedLoader(
            examples,
            cfg.data.token_budget,
            self.cost_fn,
            seed=cfg.data.seed,
            group_size=cfg.data.micro_batches * self.ctx.world_size,
            truncate=cfg.data.truncate,
        )
        self.batches = iter(self.loader)
        self.evaluator = (
            Evaluator(held_out, cfg.data.token_budget, self.cost_fn, cfg.data.truncate) if held_out else None
        )
        # the held-out split too: its loss is the run's loss
        if cfg.train.loss == "rl" and any(x[0].inference_logprobs is None for x in (examples, held_out or examples)):
            raise ConfigError("train.loss='rl' needs RL records (inference_logprobs, advantages) in the data")

        if cfg.train.compile and not self.ctx.distributed:  # parallelize applied both otherwise
            from flashnext.compile import compile_model

            compile_model(self.model)  # before checkpointing: it compiles the plain layers
        if cfg.train.activation_checkpointing and not self.ctx.distributed:
            from flashnext.activation_checkpoint import apply_activation_checkpointing

            apply_activation_checkpointing(self.model)
        self.optimizers, self.param_groups = build_optimizer(self.model, cfg.optim)
        if self.ctx.distributed:
            from flashnext.parallel import shard_aware_optimizers

            shard_aware_optimizers(self.optimizers)  # Muon orthogonalises whole matrices, not FSDP shards
        self.schedulers = Schedulers(self.optimizers, cfg.optim)
        self.step = 0
        self.tokens_seen = 0
        self.peak_flops = None

    def warn(self, message: str) -> None:
        """A warning line on stderr (rank 0 only)."""
        if self.ctx.is_main:
            print(f"flashnext train: warning: {message}", file=sys.stderr, flush=True)

    def _check_vocab(self) -> None:
        if self.tokenizer is not None and self.tokenizer.vocab_size > self.text_config.vocab_size:
            raise ConfigError(
                f"tokenizer has {self.tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{self.text_config.vocab_size}"
            )

    # ---- one step --------------------------------------------------------------------------------------
    def next_micro_batches(self) -> list[PackedBatch]:
        """This rank's micro-batches of the next step (the loader position advances for every rank's share)."""
        n, world = self.cfg.data.micro_batches, self.ctx.world_size
        step_batches = [next(self.batches) for _ in range(n * world)]
        return step_batches[self.ctx.rank :: world]

    def _forward_loss(self, b: PackedBatch, num_loss_tokens: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = self.device
        ids, cu, pos = b.input_ids.to(dev), b.cu_seqlens, b.position_ids.to(dev)
        replay = b.routed_experts.to(dev) if b.routed_experts is not None else None
        out = self.model(ids, cu_seqlens=cu, position_ids=pos, routed_experts=replay, **b.image_kwargs(dev))
        labels = b.labels.to(dev)
        if self.cfg.train.loss == "sft":
            return sft_loss(out.logits, labels, cu, num_loss_tokens), {}
        seg = make_segments(cu, ids.shape[0], pos, device=dev)
        targets = next_token_targets(labels, seg, IGNORE_INDEX)
        mask = targets != IGNORE_INDEX
        lp_train, entropy = token_logprobs(out.logits, torch.where(mask, targets, 0))
        lp_infer = next_token_targets(b.inference_logprobs.to(dev), seg, 0.0)  # aligned with the prediction at t
        adv = next_token_targets(b.advantages.to(dev), seg, 0.0)
        return rl_loss(lp_train, lp_infer, adv, mask, num_loss_tokens, self.cfg.rl, entropy=entropy)

    def train_step(self, batches: list[PackedBatch]) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step the optimizers and the schedule; returns metrics."""
        t0 = time.perf_counter()
        local_counts = [float(count_label_tokens(b.labels, b.cu_seqlens)) for b in batches]
        local_tokens = float(sum(b.num_tokens for b in batches))
        num_loss_tokens, tokens = all_reduce_sum(self.ctx, [sum(local_counts), local_tokens])
        loss_sum = torch.zeros((), dtype=torch.float64)
        rl_sums: dict[str, float] = {}
        sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2 root after `parallelize`
        for i, (b, n_local) in enumerate(zip(batches, local_counts, strict=True)):
            if sync is not None:  # reduce-scatter once per step: the last micro-batch's backward syncs the sum
                sync(i == len(batches) - 1)
            loss, metrics = self._forward_loss(b, num_loss_tokens)
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            for k, v in metrics.items():  # micro-batch means over its loss tokens -> weighted sums
                rl_sums[k] = rl_sums.get(k, 0.0) + float(v) * n_local
        t_backward = time.perf_counter()
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

        (loss_total,) = all_reduce_sum(self.ctx, [float(loss_sum)])
        seconds = time.perf_counter() - t0
        flops = 3.0 * sum(self.cost_fn(b.lengths) for b in batches)  # forward + backward (2x), no recompute
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
        if self.peak_flops:
            out["mfu"] = flops / seconds / (self.peak_flops * self.ctx.world_size)
        if rl_sums:  # loss-token means over the whole step: every micro-batch of every rank
            keys = sorted(k for k in rl_sums if not k.endswith("_tokens"))
            sums = all_reduce_sum(self.ctx, [rl_sums[k] for k in keys])
            out.update({f"rl/{k}": v / max(num_loss_tokens, 1.0) for k, v in zip(keys, sums, strict=True)})
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"step {self.step}: loss is {out['loss']}")
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

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
        `state`: the single-process `state.pt` already read by `state_io.read_checkpoint`."""
        from flashnext.parallel.dcp import STATE_FILE as SHARDED_STATE

        if (Path(path) / SHARDED_STATE).exists():
            from flashnext.parallel import load_state

            self.load_trainer_state(load_state(path, self.model, self.optimizers))
        elif self.ctx.distributed:
            raise ConfigError(
                f"{path} is a single-process checkpoint; resume it with one process, or convert it "
                "(flashnext convert) and start from the exported weights"
            )
        else:
            self.load_state_dict(state if state is not None else ckpt.load(path))

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
        history = self._loop()
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
        if cfg.log.peak_flops == "measure":
            self.peak_flops = measure_peak_flops(self.device, _DTYPES[cfg.model.dtype])
        else:
            self.peak_flops = float(cfg.log.peak_flops)
        n_params = sum(p.numel() for p in self.model.parameters())
        held_out = f", {self.evaluator.num_examples} held out" if self.evaluator else ""
        self.say(
            f"model: {n_params / 1e6:.2f}M params on {self.device} ({cfg.model.dtype}); "
            f"{len(self.loader.examples)} examples{held_out}, token budget {cfg.data.token_budget} x "
            f"{cfg.data.micro_batches} micro-batches x {self.ctx.world_size} rank(s); "
            f"peak {self.peak_flops / 1e9:.1f} GFLOP/s per device; steps {self.step} -> {cfg.train.steps}"
        )

    def _loop(self) -> list[dict[str, float]]:
        """The steps from the current one to `train.steps`: train, evaluate, log, checkpoint."""
        cfg = self.cfg
        logger = MetricsLogger(
            self.out_dir / "metrics.jsonl", enabled=self.ctx.is_main, resume_step=self.step, wandb=cfg.log.wandb_project
        )
        bar = ProgressBar(cfg.train.steps, self.step, enabled=cfg.log.progress and self.ctx.is_main)
        history = []
        try:
            while self.step < cfg.train.steps:
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


def _every(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _mean(history: list[dict[str, float]], key: str) -> float:
    values = [m[key] for m in history if key in m]
    return sum(values) / max(len(values), 1)


def _model_config_dict(model: torch.nn.Module) -> dict:
    """The config a checkpoint's `meta.json` records: the composite one for a model with a vision tower."""
    composite = getattr(model, "model_config", None)
    if composite is not None and composite.vision_config is not None:
        return composite.to_dict()
    return model.config.to_dict()


def convert_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a training checkpoint's model in the official Hugging Face layout (+ the run's tokenizer files)."""
    from flashnext.model.multimodal import FlashNextForConditionalGeneration
    from flashnext.model.text import FlashNextForCausalLM

    meta = ckpt.load_meta(checkpoint)
    state = ckpt.load(checkpoint)["model"]
    cfg = parse_config(meta["model_config"])
    with torch.device("meta"):
        model = FlashNextForConditionalGeneration(cfg) if cfg.vision_config else FlashNextForCausalLM(cfg.text)
    model.to_empty(device="cpu")
    model.reset_buffers()
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state)
    out = Path(out)
    model.save_pretrained(out)
    run = RunConfig.model_validate(meta["run_config"])
    try:
        load_tokenizer_for(run).save(out)
    except (ImportError, ConfigError, OSError):
        pass  # a run on pre-tokenized data may have no tokenizer
    return out
