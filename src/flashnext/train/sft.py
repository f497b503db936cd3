"""A run on a data file (SFT, or offline RL records): packed micro-batches, the held-out loss, the run's lines.

`PackedSource` takes `data.micro_batches` micro-batches per step for each data-parallel group from the loader (with
N groups the loader's balancing group is `micro_batches * N` and group r takes every N-th micro-batch of the step);
`ContextShards` wraps a source under context parallelism: the ranks of a CP group take the same micro-batches, each
its slice of them. `SFTWorkload` is what the training loop runs for such a run (`loop.Workload`).
"""

from __future__ import annotations

from typing import Any

import torch

from flashnext.batch import PackedBatch
from flashnext.errors import ConfigError
from flashnext.parallel.context import ContextBatch
from flashnext.train.config import RunConfig
from flashnext.train.data import ModelLimits
from flashnext.train.evaluation import Evaluator
from flashnext.train.hooks import Evaluation, PeriodicCheckpoint, Report
from flashnext.train.loop import BatchSource, Hook, Metrics
from flashnext.train.metrics import ProgressBar, measure_peak_flops
from flashnext.train.packing import CostFn, PackedLoader
from flashnext.train.setup import DTYPES, load_examples


def load_data(cfg: RunConfig, tokenizer, model: torch.nn.Module, cost_fn: CostFn, groups: int):
    """(the packed loader, the held-out `Evaluator` or None) of the data file; the examples are checked against the
    model at load. `groups`: the data-parallel groups that share each step's micro-batches."""
    composite = getattr(model, "model_config", None)  # image rows need the composite model's config
    examples, held_out = load_examples(cfg, tokenizer, ModelLimits.of(model.config), composite)
    loader = PackedLoader(
        examples,
        cfg.data.token_budget,
        cost_fn,
        seed=cfg.data.seed,
        group_size=cfg.data.micro_batches * groups,
        truncate=cfg.data.truncate,
    )
    evaluator = Evaluator(held_out, cfg.data.token_budget, cost_fn, cfg.data.truncate) if held_out else None
    if cfg.train.mtp_loss_weight > 0 and model.mtp is None:
        raise ConfigError(
            f"train.mtp_loss_weight={cfg.train.mtp_loss_weight} but the model has no MTP head (its config "
            "declares no MTP layer: set mtp_num_hidden_layers = 1, e.g. via model.overrides)"
        )
    # the held-out split too: its loss is the run's loss
    if cfg.train.loss == "rl" and any(x[0].inference_logprobs is None for x in (examples, held_out or examples)):
        raise ConfigError("train.loss='rl' needs RL records (inference_logprobs, advantages) in the data")
    return loader, evaluator


class PackedSource:
    """The packed loader's micro-batches: `micro_batches` for this data-parallel group out of each step's
    `micro_batches * groups` (the loader position advances for every group's share)."""

    def __init__(self, loader: PackedLoader, micro_batches: int, group: int, groups: int):
        self.loader, self.micro_batches, self.group, self.groups = loader, micro_batches, group, groups
        self.batches = iter(loader)

    def next_step(self, step: int) -> list[PackedBatch]:
        step_batches = [next(self.batches) for _ in range(self.micro_batches * self.groups)]
        return step_batches[self.group :: self.groups]

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["data"])
        self.batches = iter(self.loader)

    def close(self) -> None:
        pass


class ContextShards:
    """`source`'s micro-batches, each cut to this rank's slice of its CP group (`parallel.context`)."""

    def __init__(self, source: BatchSource, cp, device: torch.device):
        self.source, self.cp, self.device = source, cp, device

    def next_step(self, step: int) -> list[ContextBatch]:
        return [self.cp.shard(b, self.device) for b in self.source.next_step(step)]

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)

    def close(self) -> None:
        self.source.close()


class SFTWorkload:
    """The training loop's parts for a run on a data file: the packed source and the evaluation, metrics and
    checkpoint hooks (`trainer`: a `Trainer` whose `loader` and `evaluator` are built)."""

    def __init__(self, trainer):
        self.trainer = trainer
        cfg = trainer.cfg
        source = PackedSource(trainer.loader, cfg.data.micro_batches, trainer.dp_rank, trainer.dp_size)
        self.source = ContextShards(source, trainer.cp, trainer.device) if trainer.cp else source

    def announce(self) -> None:
        """The model, the data and the step plan; measures the MFU peak first when `log.peak_flops = "measure"`."""
        t, cfg = self.trainer, self.trainer.cfg
        if cfg.log.peak_flops == "measure":  # the GEMM rate of the dtype the matmuls run in
            t.peak_flops = measure_peak_flops(t.device, DTYPES[cfg.train.compute_dtype])
        else:
            t.peak_flops = float(cfg.log.peak_flops)
        held_out = f", {t.evaluator.num_examples} held out" if t.evaluator else ""
        t.say(
            f"model: {_params_text(t.model, t.ctx)} on {t.device} ({_precision(cfg)}); "
            f"{len(t.loader.examples)} examples{held_out}, token budget {cfg.data.token_budget} x "
            f"{cfg.data.micro_batches} micro-batches x {t.ctx.world_size} rank(s); "
            f"peak {t.peak_flops / 1e9:.1f} GFLOP/s per device; steps {t.step} -> {cfg.train.steps}"
        )

    def hooks(self) -> list[Hook]:
        t, cfg = self.trainer, self.trainer.cfg
        report = Report.of_run(t, ProgressBar, "eval_loss")
        evaluation = [Evaluation(lambda: {"eval_loss": t.eval_loss()}, cfg.train.eval_every)] if t.evaluator else []
        return [*evaluation, report, PeriodicCheckpoint(t.save_checkpoint, cfg.checkpoint.every, report.write)]

    def summary(self, history: list[Metrics]) -> str | None:
        if not history:
            return None
        first, last = history[0], history[-1]
        return (
            f"done: step {last['step']}, loss {first['loss']:.4f} -> {last['loss']:.4f}, "
            f"{sum(m['tokens'] for m in history)} tokens, mean {_mean(history, 'tokens_per_s'):,.0f} tokens/s"
            + (f", MFU {_mean(history, 'mfu'):.2%}" if "mfu" in last else "")
            + (f", eval loss {last['eval_loss']:.4f}" if "eval_loss" in last else "")
        )


def _params_text(model, ctx) -> str:
    """The whole model's parameter count, the same under torchrun as in one process (FSDP2 shards and owner-routed
    tables count their full shapes), and under torchrun rank 0's share of it."""
    from flashnext.parallel import parameter_counts

    total, local = parameter_counts(model)
    text = f"{total / 1e6:.2f}M params"
    return f"{text} ({local / 1e6:.2f}M held by rank 0 of {ctx.world_size})" if ctx.distributed else text


def _precision(cfg: RunConfig) -> str:
    if cfg.train.compute_dtype == cfg.model.dtype:
        return cfg.model.dtype
    return f"{cfg.train.compute_dtype} compute, {cfg.model.dtype} master weights"


def _mean(history: list[Metrics], key: str) -> float:
    values = [m[key] for m in history if key in m]
    return sum(values) / max(len(values), 1)
