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
import time
from pathlib import Path
from typing import Any

import torch

from flashnext.batch import PackedBatch, make_segments, next_token_targets
from flashnext.config import TextConfig, load_config, parse_config, tiny_config_dict
from flashnext.errors import ConfigError, InputError
from flashnext.parallel.dist import DistContext, destroy_distributed, init_distributed
from flashnext.train import state_io as ckpt
from flashnext.train.config import RunConfig
from flashnext.train.data import Example, load_jsonl
from flashnext.train.loss import (
    IGNORE_INDEX,
    count_label_tokens,
    count_mtp_tokens,
    mtp_loss,
    rl_loss,
    sft_loss,
    token_logprobs,
)
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
        model = build.from_pretrained(cfg.model.path, dtype=dtype, device="cpu" if distributed else device)
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
    return model.train()


def load_tokenizer_for(cfg: RunConfig):
    """The run's tokenizer: `model.tokenizer`, else the checkpoint's files, else the bundled tiny tokenizer."""
    from flashnext.tokenizer import load_tokenizer

    if cfg.model.tokenizer is not None:
        return load_tokenizer(cfg.model.tokenizer)
    if cfg.model.path is not None and (Path(cfg.model.path) / "tokenizer.json").exists():
        return load_tokenizer(cfg.model.path)
    return load_tokenizer(None)


def load_examples(cfg: RunConfig, tokenizer) -> list[Example]:
    if cfg.data.path is not None:
        path = Path(cfg.data.path)
    else:
        from flashnext.tokenizer import bundled_sft_path

        path = bundled_sft_path()
    if not path.exists():
        raise ConfigError(f"data.path={str(path)!r} does not exist")
    examples = load_jsonl(path, tokenizer, add_eos=cfg.data.add_eos)
    if not examples:
        raise InputError(f"{path}: no examples")
    return examples


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
        self.tokenizer = load_tokenizer_for(cfg) if self._needs_tokenizer() else None
        self._check_vocab()
        examples = load_examples(cfg, self.tokenizer)
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
        if cfg.train.mtp_loss_weight > 0 and getattr(self.model, "mtp", None) is None:
            raise ConfigError(
                f"train.mtp_loss_weight={cfg.train.mtp_loss_weight} but the model has no MTP head (its config "
                "declares no MTP layer: set mtp_num_hidden_layers = 1, e.g. via model.overrides)"
            )
        if cfg.train.loss == "rl" and examples[0].inference_logprobs is None:
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

    def _needs_tokenizer(self) -> bool:
        """Pre-tokenized data needs no tokenizer; text data and the bundled corpus do."""
        path = self.cfg.data.path
        if path is None:
            return True
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    try:
                        return "input_ids" not in json.loads(line)
                    except json.JSONDecodeError:
                        return True  # let the loader report the line
        return False

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

    def _forward_loss(
        self, b: PackedBatch, num_loss_tokens: float, num_mtp_tokens: float = 0.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """(loss, RL metrics, the MTP head's loss or None when `train.mtp_loss_weight` is 0) of one micro-batch."""
        dev = self.device
        ids, cu, pos = b.input_ids.to(dev), b.cu_seqlens, b.position_ids.to(dev)
        replay = b.routed_experts.to(dev) if b.routed_experts is not None else None
        with_mtp = self.cfg.train.mtp_loss_weight > 0
        mtp_kw = {"return_mtp": True} if with_mtp else {}
        out = self.model(ids, cu_seqlens=cu, position_ids=pos, routed_experts=replay, **b.image_kwargs(dev), **mtp_kw)
        labels = b.labels.to(dev)
        mtp = mtp_loss(out.mtp_logits, labels, cu, num_mtp_tokens) if with_mtp else None
        if self.cfg.train.loss == "sft":
            return sft_loss(out.logits, labels, cu, num_loss_tokens), {}, mtp
        seg = make_segments(cu, ids.shape[0], pos, device=dev)
        targets = next_token_targets(labels, seg, IGNORE_INDEX)
        mask = targets != IGNORE_INDEX
        lp_train, entropy = token_logprobs(out.logits, torch.where(mask, targets, 0))
        lp_infer = next_token_targets(b.inference_logprobs.to(dev), seg, 0.0)  # aligned with the prediction at t
        adv = next_token_targets(b.advantages.to(dev), seg, 0.0)
        return (*rl_loss(lp_train, lp_infer, adv, mask, num_loss_tokens, self.cfg.rl, entropy=entropy), mtp)

    def train_step(self, batches: list[PackedBatch]) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step the optimizers and the schedule; returns metrics."""
        t0 = time.perf_counter()
        local_counts = [float(count_label_tokens(b.labels, b.cu_seqlens)) for b in batches]
        local_tokens = float(sum(b.num_tokens for b in batches))
        mtp_weight = self.cfg.train.mtp_loss_weight
        local_mtp = sum(float(count_mtp_tokens(b.labels, b.cu_seqlens)) for b in batches) if mtp_weight else 0.0
        num_loss_tokens, tokens, num_mtp_tokens = all_reduce_sum(self.ctx, [sum(local_counts), local_tokens, local_mtp])
        loss_sum = torch.zeros((), dtype=torch.float64)
        mtp_sum = 0.0
        rl_sums: dict[str, float] = {}
        sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2 root after `parallelize`
        for i, (b, n_local) in enumerate(zip(batches, local_counts, strict=True)):
            if sync is not None:  # reduce-scatter once per step: the last micro-batch's backward syncs the sum
                sync(i == len(batches) - 1)
            loss, metrics, mtp = self._forward_loss(b, num_loss_tokens, num_mtp_tokens)
            (loss if mtp is None else loss + mtp_weight * mtp).backward()
            loss_sum += loss.detach().double().cpu()
            mtp_sum += 0.0 if mtp is None else float(mtp.detach())
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
        if mtp_weight:  # the head's own loss (mean over the step's MTP targets), beside the trunk's `loss`
            (out["mtp_loss"],) = all_reduce_sum(self.ctx, [mtp_sum])
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

    def load_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint of either format (a sharded one at any world size, including a single process)."""
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
            self.load_state_dict(ckpt.load(path))

    def maybe_resume(self) -> Path | None:
        """Load the checkpoint `checkpoint.resume` names (`latest`: newest one, if any)."""
        where = self.cfg.checkpoint.resume
        if where is None:
            return None
        path = ckpt.latest(self.out_dir / "checkpoints") if where == "latest" else Path(where)
        if path is None:
            self.say(f"resume=latest: no checkpoint in {self.out_dir / 'checkpoints'}, starting fresh")
            return None
        ckpt.load_meta(path)  # a clear error for a directory that is no checkpoint
        self.load_checkpoint(path)
        self.say(f"resumed from {path} at step {self.step}")
        return path

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        """Train to `train.steps`, logging and checkpointing; returns the metrics of the steps run here."""
        cfg = self.cfg
        self.maybe_resume()
        if cfg.log.peak_flops == "measure":
            self.peak_flops = measure_peak_flops(self.device, _DTYPES[cfg.model.dtype])
        else:
            self.peak_flops = float(cfg.log.peak_flops)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.say(
            f"model: {n_params / 1e6:.2f}M params on {self.device} ({cfg.model.dtype}); "
            f"{len(self.loader.examples)} examples, token budget {cfg.data.token_budget} x "
            f"{cfg.data.micro_batches} micro-batches x {self.ctx.world_size} rank(s); "
            f"peak {self.peak_flops / 1e9:.1f} GFLOP/s per device; steps {self.step} -> {cfg.train.steps}"
        )
        logger = MetricsLogger(
            self.out_dir / "metrics.jsonl", enabled=self.ctx.is_main, resume_step=self.step, wandb=cfg.log.wandb_project
        )
        bar = ProgressBar(cfg.train.steps, self.step, enabled=cfg.log.progress and self.ctx.is_main)
        history = []
        try:
            while self.step < cfg.train.steps:
                metrics = self.train_step(self.next_micro_batches())
                history.append(metrics)
                bar.update(metrics)
                if self.step % cfg.log.every == 0 or self.step == cfg.train.steps:
                    logger.log(metrics)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < cfg.train.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            logger.close()
        if history:
            path = self.save_checkpoint()
            self.say(f"checkpoint: {path}")
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
            )
        return history

    def export(self, path: Path) -> None:
        """The current weights in the official Hugging Face layout (+ the tokenizer files); collective.

        With a process group every rank writes what it owns (n-gram table shards) and rank 0 the rest.
        """
        if self.ctx.distributed:
            from flashnext.parallel import export_pretrained

            export_pretrained(self.model, path)
        else:
            self.model.save_pretrained(path)
        if self.ctx.is_main and self.tokenizer is not None and hasattr(self.tokenizer, "save"):
            self.tokenizer.save(path)


def _mean(history: list[dict[str, float]], key: str) -> float:
    values = [m[key] for m in history if key in m]
    return sum(values) / max(len(values), 1)


# ---- command line --------------------------------------------------------------------------------------
USAGE = """usage: flashnext train [--config RUN.toml] [--resume [latest|DIR]] [--print-config] [--SECTION.FIELD=V ...]

Train on packed sequences as the run config says (defaults: the embedded tiny model on the bundled corpus).
  --config PATH        TOML run config (sections model, data, optim, rl, train, checkpoint, log)
  --resume [WHERE]     continue from the newest checkpoint in <out_dir>/checkpoints, or from WHERE
  --print-config       print the resolved config as TOML-like JSON and exit
  --section.field=V    override one field; V is a TOML literal or a bare string (e.g. --train.steps=20)
"""


def parse_args(argv: list[str]) -> tuple[RunConfig, bool]:
    """`flashnext train` arguments -> (run config, print_config)."""
    from flashnext.train.config import load_run_config

    config_path, overrides, print_config = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if arg == "--config" or arg.startswith("--config="):
            if "=" in arg:
                config_path = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                config_path, i = argv[i + 1], i + 1
            else:
                raise ConfigError("--config needs a path")
        elif arg == "--resume" or arg.startswith("--resume="):
            where = "latest"
            if "=" in arg:
                where = arg.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                where, i = argv[i + 1], i + 1
            overrides.append(f"--checkpoint.resume={json.dumps(where)}")
        elif arg == "--print-config":
            print_config = True
        elif arg.startswith("--") and "=" in arg:
            overrides.append(arg)
        else:
            raise ConfigError(f"unknown argument {arg!r} (overrides look like --section.field=value)\n{USAGE}")
        i += 1
    return load_run_config(config_path, overrides), print_config


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flashnext train` and `python -m flashnext.train`."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, print_config = parse_args(argv)
        if print_config:
            print(json.dumps(cfg.model_dump(mode="json"), indent=2))
            return 0
        # under torchrun: one process group over every rank (gloo on CPU, NCCL on CUDA); else a single process
        device = None if cfg.train.device == "auto" else resolve_device(cfg.train.device)
        ctx = init_distributed(device=device)
        try:
            Trainer(cfg, ctx).run()
        finally:
            destroy_distributed(ctx)
    except (ConfigError, InputError, OSError) as e:
        print(f"flashnext train: error: {e}", file=sys.stderr)
        return 1
    return 0


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
