"""The RL loop: rollouts from the engine -> rewards and advantages -> an IPO step of the trainer -> weight sync.

`RLTrainer` is the `Trainer` (model, optimizers, `train_step` with the RL loss and router replay, checkpoints,
resume, export) fed by an `Orchestrator` instead of a data file. One step s:
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

from typing import Any

import torch

from flashnext.errors import ConfigError
from flashnext.parallel.dist import DistContext
from flashnext.rl import weights
from flashnext.rl.config import RLRunConfig
from flashnext.rl.envs import load_environment
from flashnext.rl.inference import LocalInference, RemoteInference, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator, RolloutBatch, RolloutPipeline
from flashnext.rl.rollouts import empty_like, pack_samples
from flashnext.train.interrupt import StopOnSignal, check_stop, keep_work
from flashnext.train.metrics import MetricsLogger, ProgressBar
from flashnext.train.packing import flop_cost
from flashnext.train.trainer import Trainer


class RLTrainer(Trainer):
    """A `Trainer` whose batches are rollouts. Rank 0 runs the orchestrator (and, in one process, the engine).

    Args:
        cfg: the RL run config.
        ctx: rank / world size (under torchrun, `inference.url` must name a server).
        say: where progress lines go (rank 0).
    """

    def __init__(self, cfg: RLRunConfig, ctx: DistContext | None = None, say=print):
        super().__init__(cfg, ctx, say)
        if self.ctx.distributed and cfg.inference.url is None:
            raise ConfigError("under torchrun the rollouts come from a server: set inference.url (--inference-url)")
        self.engine = self.client = self.sync_client = None
        self.pipeline: RolloutPipeline | None = None
        self.model_config = getattr(self.model, "model_config", None) or self.text_config
        if self.ctx.is_main:
            self._build_orchestrator()

    # ---- what the base Trainer builds differently --------------------------------------------------------
    def _build_data(self) -> None:
        """No data file: the orchestrator's rollouts are the data."""
        self.cost_fn = flop_cost(self.text_config)
        self.loader = self.evaluator = None

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "schedulers": self.schedulers.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "orchestrator": self.pipeline.state_dict() if self.pipeline is not None else {},
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.schedulers.load_state_dict(state["schedulers"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state.get("orchestrator", {}))

    # ---- rollouts and weights --------------------------------------------------------------------------
    def _build_orchestrator(self) -> None:
        cfg = self.cfg
        self.env = load_environment(
            cfg.env.name, cfg.env.args, seed=cfg.env.seed, eval_percent=cfg.env.eval_percent,
            max_tokens=cfg.env.max_tokens,
        )  # fmt: skip
        self.env.setup(self.tokenizer, self.model_config)
        if cfg.inference.url is None:
            self.client = LocalInference(self._local_engine())
        else:
            import os

            inf = cfg.inference
            self.client = RemoteInference(inf.url, os.environ.get(inf.api_key_env) or None)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else self.text_config.eos_id
        spec = SamplingSpec(cfg.max_tokens, cfg.rl.temperature, [eos], cfg.orchestrator.router_replay)
        o = cfg.orchestrator
        self.orch = Orchestrator(self.env, self.client, spec, o.batch_size, o.group_size, o.seed, o.std_normalize,
                                 o.drop_zero_advantage, o.eval_tasks, o.eval_temperature, o.nan_rewards)  # fmt: skip
        self.pipeline = RolloutPipeline(self.orch, o.max_off_policy_steps)

    def _local_engine(self):
        """An engine over a second instance of the model (built as the trainer's; its weights come by sync)."""
        from flashnext.serve.engine import Engine
        from flashnext.train.setup import build_model

        inf = self.cfg.inference
        self.engine = Engine(build_model(self.cfg, self.device), self.tokenizer, inf.max_slots, inf.max_model_len,
                             inf.max_batched_tokens)  # fmt: skip
        return self.engine

    def sync_weights(self, full: bool = False) -> weights.SyncStats:
        """The trainer's weights -> the engine (collective under torchrun); the engine's version becomes the step."""
        if self.pipeline is not None:
            self.pipeline.wait_idle()
        if self.cfg.inference.url is None:
            return weights.sync_local(self.model, self.engine, full=full, version=self.step)
        if self.sync_client is None:
            import os

            inf = self.cfg.inference
            key = os.environ.get(inf.admin_key_env) or None
            if key is None:
                raise ConfigError(f"weight sync to {inf.url} needs the server's admin key in ${inf.admin_key_env}")
            self.sync_client = weights.HTTPWeightSync(inf.url, key, int(inf.sync_chunk_mb * 2**20))
        return weights.sync_distributed(self.model, self.sync_client, self.step, full=False)

    def _step_batches(self, batch: RolloutBatch | None):
        """This rank's micro-batches of the step: rank 0 packs, every rank gets its share (padded with loss-free
        stand-ins so all ranks run the same number of forwards)."""
        micro = []
        if batch is not None and batch.samples:
            L, k = self.text_config.num_hidden_layers, self.text_config.num_experts_per_tok
            cfg = getattr(self.model, "model_config", None)
            vision = getattr(cfg, "vision_config", None)
            mrope = (vision.spatial_merge_size, cfg.image_token_id) if vision is not None else None
            micro = pack_samples(batch.samples, self.cfg.orchestrator.micro_batch_tokens, L, k, mrope)
        world = self.ctx.world_size
        if world > 1:
            import torch.distributed as dist

            box = [micro]
            dist.broadcast_object_list(box, src=0)
            micro = box[0]
            while len(micro) % world:
                micro.append(empty_like(micro[0]))
            micro = micro[self.ctx.rank :: world]
        return micro

    # ---- the run ---------------------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        """Train to `train.steps`: rollouts, IPO steps, weight syncs, evaluations, checkpoints; returns the
        metrics of the steps run here."""
        self._claim_out_dir()
        self.maybe_resume()
        if self.step >= self.cfg.train.steps:
            self.say(f"run already finished at step {self.step} (train.steps={self.cfg.train.steps})")
            return []
        first_sync = self.sync_weights(full=self.cfg.inference.url is None)
        self.say(
            f"rl: env {self.cfg.env.name!r}, {self.cfg.orchestrator.batch_size} prompts x "
            f"{self.cfg.orchestrator.group_size} samples per step, max_off_policy_steps "
            f"{self.cfg.orchestrator.max_off_policy_steps}, rollouts from "
            f"{self.cfg.inference.url or 'an engine in this process'}; steps {self.step} -> {self.cfg.train.steps}; "
            f"weights synced in {first_sync.seconds:.2f}s"
        )
        try:
            history = keep_work(self, self._loop)  # SIGINT/SIGTERM or a failure: the last completed step is saved
            path = self.save_checkpoint()
        finally:
            if self.pipeline is not None:
                self.pipeline.close()
        self.say(f"checkpoint: {path}")
        if self.cfg.checkpoint.export:
            self.export(self.out_dir / "final")
            self.say(f"exported the model in the official layout to {self.out_dir / 'final'}")
        self._summary(history)
        return history

    def _loop(self, stop: StopOnSignal) -> list[dict[str, float]]:
        cfg = self.cfg
        logger = MetricsLogger(self.out_dir / "metrics.jsonl", enabled=self.ctx.is_main, resume_step=self.step,
                               wandb=cfg.log.wandb_project)  # fmt: skip
        bar = RLProgressBar(cfg.train.steps, self.step, enabled=cfg.log.progress and self.ctx.is_main)
        history = []
        try:
            if self.step == 0 and self.ctx.is_main and cfg.orchestrator.eval_tasks:
                start = {"step": 0, **self.orch.evaluate()}
                logger.log(start)
                bar.eval = start
                history.append(start)
            while self.step < cfg.train.steps:
                check_stop(self, stop)
                metrics = self.rl_step()
                last = self.step == cfg.train.steps
                every = cfg.orchestrator.eval_every
                if self.ctx.is_main and cfg.orchestrator.eval_tasks and (last or (every and self.step % every == 0)):
                    metrics.update(self.orch.evaluate())
                history.append(metrics)
                bar.update(metrics)
                if self.step % cfg.log.every == 0 or last or "reward/eval_mean" in metrics:
                    logger.log(metrics)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and not last:
                    bar.write(f"checkpoint: {self.save_checkpoint()}", self.say)
        finally:
            bar.close()
            logger.close()
        return history

    def rl_step(self) -> dict[str, float]:
        """One RL step (see the module doc); collective under torchrun. Returns its metrics (rank 0's complete)."""
        s, k = self.step + 1, self.cfg.orchestrator.max_off_policy_steps
        batch, stale = None, 0
        if self.pipeline is not None:
            for future in range(s, s + k + 1):
                self.pipeline.launch(future, self.step)
            batch, stale = self.pipeline.get(s, self.step)
        metrics = self.train_step(self._step_batches(batch))
        sync = self.sync_weights()
        metrics.update(sync.metrics())
        if batch is not None:
            ages = [self.step - 1 - x.policy_step for x in batch.samples]
            metrics.update(batch.stats)
            metrics.update({
                "off_policy/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
                "off_policy/staleness_max": max(ages, default=0),
                "off_policy/dropped": stale, "off_policy/dropped_total": self.pipeline.dropped_stale,
            })  # fmt: skip
        return metrics

    def _summary(self, history: list[dict[str, float]]) -> None:
        evals = [m["reward/eval_mean"] for m in history if "reward/eval_mean" in m]
        steps = [m for m in history if "loss" in m]
        if not steps:
            return
        kl = max(m.get("rl/mismatch_kl", 0.0) for m in steps)
        self.say(
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

    def update(self, m: dict[str, Any]) -> None:
        if "reward/eval_mean" in m:
            self.eval = m
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
