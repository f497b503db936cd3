"""The RL run: rollouts from the engine -> rewards and advantages -> an IPO step of the trainer -> weight sync.

An RL run is the `Trainer` (model, optimizers, `train_step` with the RL loss and router replay, checkpoints,
resume, export) running the one training loop (`train/loop.py`) with the `RLWorkload`: a `RolloutSource` (the
`Orchestrator`'s rollouts instead of a data file) and, after each step, the `WeightSync` hook, the rollouts'
statistics and the reward evaluation. One step s:
1. the `RolloutPipeline` hands over step s's rollouts (sampled by the policy of step `s - 1 - k` at most,
   `orchestrator.max_off_policy_steps = k`; a batch staler than that is dropped, counted, and resampled) and
   launches the sampling of step s + k on the engine's current weights;
2. rank 0 packs the kept samples into micro-batches (`rollouts.pack_samples`) and shares them out over the ranks;
3. `train_step`: forward with the engine's routed experts replayed, the IPO loss against the engine's log-probs;
4. once the pipeline is idle, the new weights go to the engine: in place in one process (`weights.sync_local`),
   streamed to the server across processes (`weights.sync_distributed`); the engine's weight version becomes s;
5. every `orchestrator.eval_every` steps (and before the first and after the last) the held-out reward.
Metrics per step (`metrics.jsonl`, the progress bar): the trainer's (loss, `rl/mismatch_kl*`, `rl/masked_fraction`,
`rl/entropy`, tokens/s), `reward/*` (train mean/std and metrics, `reward/eval_*`), `rollout/*` (samples, dropped
groups, failures, rollout tokens/s), `off_policy/*` (staleness, stale drops) and `sync/*` (seconds, bytes, peak
extra bytes). Checkpoints add the rollouts already sampled for future steps, so `--resume` continues exactly.
SIGINT/SIGTERM finish the step in flight and save; an exception (an environment's error, a failed rollout) saves
the last completed step before it ends the run (`train/interrupt.py`).
"""

from __future__ import annotations

import os
from typing import Any

from flashnext.errors import ConfigError
from flashnext.parallel.dist import DistContext
from flashnext.rl import weights
from flashnext.rl.config import RLRunConfig
from flashnext.rl.envs import load_environment
from flashnext.rl.inference import LocalInference, RemoteInference, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator, RolloutBatch, RolloutPipeline
from flashnext.rl.rollouts import empty_like, pack_samples
from flashnext.train.hooks import Evaluation, PeriodicCheckpoint, Report
from flashnext.train.loop import Hook, Metrics
from flashnext.train.metrics import ProgressBar
from flashnext.train.trainer import Trainer


def rl_trainer(cfg: RLRunConfig, ctx: DistContext | None = None, say=print) -> Trainer:
    """The `Trainer` of an RL run: rank 0 runs the orchestrator (and, in one process, the engine).

    Args:
        cfg: the RL run config.
        ctx: rank / world size (under torchrun, `inference.url` must name a server).
        say: where progress lines go (rank 0).
    """
    return Trainer(cfg, ctx, say, workload=RLWorkload)


RLTrainer = rl_trainer  # the name the commands, tests and docs know


class RolloutSource:
    """Each step's rollouts (rank 0: the off-policy pipeline over the orchestrator), packed into micro-batches and
    shared out over the ranks; `batch` / `stale` are the last step's (for `RolloutStats`)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.cfg = trainer, trainer.cfg
        self.engine = self.client = self.env = self.orch = None
        self.pipeline: RolloutPipeline | None = None
        self.batch: RolloutBatch | None = None
        self.stale = 0
        if trainer.ctx.is_main:
            self._build_orchestrator()

    def _build_orchestrator(self) -> None:
        cfg, t = self.cfg, self.trainer
        self.env = load_environment(
            cfg.env.name, cfg.env.args, seed=cfg.env.seed, eval_percent=cfg.env.eval_percent,
            max_tokens=cfg.env.max_tokens,
        )  # fmt: skip
        self.env.setup(t.tokenizer, getattr(t.model, "model_config", None) or t.text_config)
        if cfg.inference.url is None:
            self.client = LocalInference(self._local_engine())
        else:
            inf = cfg.inference
            self.client = RemoteInference(inf.url, os.environ.get(inf.api_key_env) or None)
        eos = t.tokenizer.eos_token_id if t.tokenizer is not None else t.text_config.eos_id
        spec = SamplingSpec(cfg.max_tokens, cfg.rl.temperature, [eos], cfg.orchestrator.router_replay)
        o = cfg.orchestrator
        self.orch = Orchestrator(self.env, self.client, spec, o.batch_size, o.group_size, o.seed, o.std_normalize,
                                 o.drop_zero_advantage, o.eval_tasks, o.eval_temperature, o.nan_rewards)  # fmt: skip
        self.pipeline = RolloutPipeline(self.orch, o.max_off_policy_steps)

    def _local_engine(self):
        """An engine over a second instance of the model (built as the trainer's; its weights come by sync)."""
        from flashnext.quant.apply import QuantScheme, quantize_model
        from flashnext.serve.engine import Engine
        from flashnext.train.setup import build_model

        inf, t = self.cfg.inference, self.trainer
        model = quantize_model(build_model(self.cfg, t.device), QuantScheme.from_flags(inf.weights))
        self.engine = Engine(model, t.tokenizer, inf.max_slots, inf.max_model_len, inf.max_batched_tokens)
        return self.engine

    def next_step(self, step: int) -> list:
        """Step `step + 1`'s rollouts (launching the sampling of the steps up to `step + 1 + k`); this rank's
        micro-batches of them (collective under torchrun)."""
        s, k = step + 1, self.cfg.orchestrator.max_off_policy_steps
        self.batch, self.stale = None, 0
        if self.pipeline is not None:
            for future in range(s, s + k + 1):
                self.pipeline.launch(future, step)
            self.batch, self.stale = self.pipeline.get(s, step)
        return self._share(self.batch)

    def _share(self, batch: RolloutBatch | None) -> list:
        """Rank 0 packs, every rank gets its share (padded with loss-free stand-ins so all ranks run the same
        number of forwards)."""
        t, micro = self.trainer, []
        if batch is not None and batch.samples:
            L, k = t.text_config.num_hidden_layers, t.text_config.num_experts_per_tok
            cfg = getattr(t.model, "model_config", None)
            vision = getattr(cfg, "vision_config", None)
            mrope = (vision.spatial_merge_size, cfg.image_token_id) if vision is not None else None
            micro = pack_samples(batch.samples, self.cfg.orchestrator.micro_batch_tokens, L, k, mrope)
        world = t.ctx.world_size
        if world > 1:
            import torch.distributed as dist

            box = [micro]
            dist.broadcast_object_list(box, src=0)
            micro = box[0]
            while len(micro) % world:
                micro.append(empty_like(micro[0]))
            micro = micro[t.ctx.rank :: world]
        return micro

    def wait_idle(self) -> None:
        if self.pipeline is not None:
            self.pipeline.wait_idle()

    def state_dict(self) -> dict[str, Any]:
        """The rollouts already sampled for future steps."""
        return {"orchestrator": self.pipeline.state_dict() if self.pipeline is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state.get("orchestrator", {}))

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()


class WeightSync:
    """After each step, the trainer's weights -> the engine (in place in one process, streamed to the server
    across processes; collective under torchrun) once the rollouts in flight are sampled; `sync/*` metrics."""

    def __init__(self, trainer: Trainer, source: RolloutSource):
        self.trainer, self.source, self.http = trainer, source, None

    def __call__(self, full: bool = False) -> weights.SyncStats:
        """Sync now; the engine's weight version becomes the trainer's step."""
        t, inf = self.trainer, self.trainer.cfg.inference
        self.source.wait_idle()
        if inf.url is None:
            return weights.sync_local(t.model, self.source.engine, full=full, version=t.step)
        if self.http is None:
            key = os.environ.get(inf.admin_key_env) or None
            if key is None:
                raise ConfigError(f"weight sync to {inf.url} needs the server's admin key in ${inf.admin_key_env}")
            self.http = weights.HTTPWeightSync(inf.url, key, int(inf.sync_chunk_mb * 2**20))
        return weights.sync_distributed(t.model, self.http, t.step, full=False)

    def start(self, row: Metrics) -> None:
        pass

    def after_step(self, metrics: Metrics, last: bool) -> None:
        metrics.update(self(full=False).metrics())

    def close(self) -> None:
        pass


class RolloutStats:
    """The step's rollout metrics (`reward/*`, `rollout/*`) and its staleness (`off_policy/*`), on rank 0."""

    def __init__(self, source: RolloutSource):
        self.source = source

    def start(self, row: Metrics) -> None:
        pass

    def after_step(self, metrics: Metrics, last: bool) -> None:
        batch = self.source.batch
        if batch is None:
            return
        ages = [metrics["step"] - 1 - x.policy_step for x in batch.samples]
        metrics.update(batch.stats)
        metrics.update({
            "off_policy/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "off_policy/staleness_max": max(ages, default=0),
            "off_policy/dropped": self.source.stale, "off_policy/dropped_total": self.source.pipeline.dropped_stale,
        })  # fmt: skip

    def close(self) -> None:
        pass


class RLWorkload:
    """The training loop's parts for an RL run (`loop.Workload`): rollouts in, weight sync and evaluation out."""

    def __init__(self, trainer: Trainer):
        if trainer.ctx.distributed and trainer.cfg.inference.url is None:
            raise ConfigError("under torchrun the rollouts come from a server: set inference.url (--inference-url)")
        self.trainer = trainer
        self.source = RolloutSource(trainer)
        self.sync_weights = WeightSync(trainer, self.source)

    def announce(self) -> None:
        """The first weight sync (the whole model to an engine in this process), then the run's line."""
        t, cfg = self.trainer, self.trainer.cfg
        first_sync = self.sync_weights(full=cfg.inference.url is None)
        o = cfg.orchestrator
        t.say(
            f"rl: env {cfg.env.name!r}, {o.batch_size} prompts x {o.group_size} samples per step, "
            f"max_off_policy_steps {o.max_off_policy_steps}, rollouts from "
            f"{cfg.inference.url or 'an engine in this process'}; steps {t.step} -> {cfg.train.steps}; "
            f"weights synced in {first_sync.seconds:.2f}s"
        )

    def hooks(self) -> list[Hook]:
        t, cfg = self.trainer, self.trainer.cfg
        report = Report.of_run(t, RLProgressBar, "reward/eval_mean")
        o = cfg.orchestrator
        evaluation = [Evaluation(self.source.orch.evaluate, o.eval_every, at_start=True)] if (
            t.ctx.is_main and o.eval_tasks) else []  # fmt: skip
        return [self.sync_weights, RolloutStats(self.source), *evaluation, report,
                PeriodicCheckpoint(t.save_checkpoint, cfg.checkpoint.every, report.write)]  # fmt: skip

    def summary(self, history: list[Metrics]) -> str | None:
        evals = [m["reward/eval_mean"] for m in history if "reward/eval_mean" in m]
        steps = [m for m in history if "loss" in m]
        if not steps:
            return None
        kl = max(m.get("rl/mismatch_kl", 0.0) for m in steps)
        return (
            f"done: step {steps[-1]['step']}, train reward {steps[0].get('reward/mean', float('nan')):.3f} -> "
            f"{steps[-1].get('reward/mean', float('nan')):.3f}"
            + (f", eval reward {evals[0]:.3f} -> {evals[-1]:.3f}" if len(evals) > 1 else "")
            + f", max mismatch KL {kl:.2e}"
        )


class RLProgressBar(ProgressBar):
    """The progress bar of an RL run: train and eval reward, mismatch KL, rollout and train tokens/s."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        super().__init__(total, initial, enabled)
        self.eval: dict[str, float] = {}

    def note(self, m: dict[str, Any]) -> None:
        if "reward/eval_mean" in m:
            self.eval = m

    def update(self, m: dict[str, Any]) -> None:
        self.note(m)
        if self.bar is None:
            return
        post = {"reward": f"{m.get('reward/mean', float('nan')):.3f}"}
        if self.eval:
            post["eval"] = f"{self.eval['reward/eval_mean']:.3f}"
        post.update({"kl": f"{m.get('rl/mismatch_kl', 0.0):.1e}",
                     "roll tok/s": f"{m.get('rollout/tokens_per_s', 0.0):,.0f}",
                     "train tok/s": f"{m['tokens_per_s']:,.0f}"})  # fmt: skip
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
