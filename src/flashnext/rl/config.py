"""The run config of `flashnext rl`: the training run config plus `[orchestrator]`, `[env]` and `[inference]`.

Every section of `flashnext train`'s run config keeps its meaning (`[model]`, `[optim]`, `[rl]` (the loss, and the
sampling temperature both sides share), `[train]`, `[checkpoint]`, `[log]`), except `[data]`: an RL run's data are
the environment's tasks, so `[data]` is refused. `train.loss` is `rl`. A `warm_start` SFT run config is trained first
when `model.path` does not exist yet (the tiny recipe starts from the tiny SFT run's `final/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flashnext.errors import FieldsError
from flashnext.train.config import RunConfig, load_run_config

_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class OrchestratorSection(BaseModel):
    """How rollouts are sampled, scored and turned into training batches."""

    model_config = _STRICT

    batch_size: int = Field(8, ge=1)
    """Prompts (tasks) per step."""
    group_size: int = Field(8, ge=1)
    """Completions sampled per prompt (they share its prefill); advantages are relative to the group."""
    max_tokens: int | None = Field(None, ge=1)
    """Completion budget in tokens; None: the environment's `max_tokens`."""
    std_normalize: bool = False
    """Divide each advantage by its group's reward standard deviation (prime-rl's default does not)."""
    drop_zero_advantage: bool = True
    """Leave out groups whose rewards are all equal (every advantage 0: nothing to learn)."""
    max_off_policy_steps: int = Field(1, ge=0)
    """How many trainer steps older than the current policy a sample may be: rollouts of step n + k are sampled
    while the trainer takes step n (k = this); samples older than the bound are dropped and counted. 0: synchronous
    (sampler and learner hold the same weights)."""
    router_replay: bool = True
    """Record the engine's routed experts and replay them in the trainer's forward."""
    micro_batch_tokens: int = Field(2048, ge=1)
    """Most tokens in one packed training micro-batch (a longer sample trains alone)."""
    seed: int = 0
    """Seed of the sampling (each prompt's seed is derived from it, the step and the prompt's index)."""
    eval_every: int = Field(0, ge=0)
    """Held-out eval reward every N steps, and before the first and after the last step; 0: before and after only."""
    eval_tasks: int = Field(64, ge=0)
    """Held-out tasks per evaluation (0: no evaluation)."""
    eval_temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of the evaluation (0: greedy)."""
    nan_rewards: Literal["error", "skip"] = "error"
    """A NaN reward (the environment could not score a completion): `error` stops the run with a line naming the
    environment and the task; `skip` leaves the sample out of its group (as a failed completion) and counts it
    (`rollout/nan_rewards`, `rollout/nan_groups`, `reward/eval_nan`). An infinite or out-of-range reward is always
    an error."""


class EnvSection(BaseModel):
    """The environment: its tasks, prompts and rewards."""

    model_config = _STRICT

    name: str = "reverse"
    """A built-in environment (`reverse`, `arith`, `color`), `module:Class` (a subclass of
    `flashnext.rl.envs.Environment`) or `verifiers:NAME` (an installed verifiers taskset, single-turn)."""
    args: dict[str, Any] = {}
    """Keyword arguments of the environment (e.g. `{min_len = 3, max_len = 8}` for `reverse`)."""
    seed: int = 0
    """Seed of the task generator (the run's data order)."""
    eval_percent: int = Field(10, gt=0, lt=100)
    """Percent of task keys held out for the eval split (the splits are disjoint)."""
    max_tokens: int = Field(16, ge=1)
    """The environment's completion budget (`orchestrator.max_tokens` overrides it)."""


class InferenceSection(BaseModel):
    """Where rollouts are sampled and where new weights go."""

    model_config = _STRICT

    url: str | None = None
    """A running `flashnext serve --admin-key KEY` (e.g. `http://127.0.0.1:8000`); None: an engine in this process
    (one process only; under torchrun give the server's URL)."""
    api_key_env: str = "FLASHNEXT_API_KEY"
    """Environment variable holding the server's `--api-key` (unset: none)."""
    admin_key_env: str = "FLASHNEXT_ADMIN_KEY"
    """Environment variable holding the server's `--admin-key` (weight updates)."""
    max_slots: int = Field(64, ge=1)
    """In-process engine: concurrent sequences (at least `orchestrator.group_size`)."""
    max_model_len: int = Field(512, ge=2)
    """In-process engine: longest prompt + completion."""
    max_batched_tokens: int = Field(1024, ge=1)
    """In-process engine: token budget of one engine step."""
    weights: Literal["bf16", "int8", "int4"] = "bf16"
    """In-process engine: its model quantized in memory for the CPU (`flashnext serve --weights`; bf16: as the
    trainer's dtype); every weight sync requantizes on arrival. A server quantizes by its own flags."""
    sync_chunk_mb: float = Field(64, gt=0)
    """Across processes: the largest piece of a tensor sent at once (larger tensors and table shards go in row
    pieces), in MiB."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None:
            check_http_url(url)
        return url


def check_http_url(url: str) -> str:
    """`url` if it is an `http://` or `https://` URL with a host (and a valid port, if any), else a `ValueError`
    saying what is wrong (`--inference-url` / `inference.url` is checked before anything is built)."""
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    try:
        port = u.port
    except ValueError:
        port = -1
    if u.scheme not in ("http", "https") or not u.hostname or port == -1 or any(c.isspace() for c in url):
        raise ValueError("expected a server URL such as http://127.0.0.1:8000 (http or https, a host, a port)")
    return url


class RLRunConfig(RunConfig):
    """An RL run (`flashnext rl`)."""

    out_dir: str = "runs/tiny-rl"
    """Run directory: `metrics.jsonl`, `checkpoints/`, `final/`."""
    warm_start: str | None = None
    """An SFT run config (TOML) trained first when `model.path` does not exist; its `out_dir`'s `final/` must be
    `model.path`. None: `model.path` (or a random init) as is."""
    orchestrator: OrchestratorSection = OrchestratorSection()
    env: EnvSection = EnvSection()
    inference: InferenceSection = InferenceSection()

    @model_validator(mode="after")
    def _eval_source(self) -> RLRunConfig:
        # replaces the training run's rule: an RL run evaluates rewards on its environment's eval split
        if self.train.eval_every:
            raise FieldsError("an RL run evaluates rewards every orchestrator.eval_every steps; leave train.eval_every "
                              "at 0", ("train.eval_every", "orchestrator.eval_every"))  # fmt: skip
        return self

    @model_validator(mode="after")
    def _rl_rules(self) -> RLRunConfig:
        if self.data.model_fields_set:
            raise FieldsError("an RL run's data are its environment's tasks ([env]); remove the [data] section",
                              ("data",))  # fmt: skip
        if "loss" in self.train.model_fields_set and self.train.loss != "rl":
            raise FieldsError(f"flashnext rl trains with loss 'rl', got {self.train.loss!r}", ("train.loss",))
        self.train.loss = "rl"
        if self.orchestrator.group_size > self.inference.max_slots:
            raise FieldsError(
                f"orchestrator.group_size={self.orchestrator.group_size} needs as many engine slots; "
                f"inference.max_slots={self.inference.max_slots}",
                ("orchestrator.group_size", "inference.max_slots"),
            )
        if self.warm_start is not None and self.model.path is None:
            raise FieldsError("warm_start trains the SFT run whose final/ is model.path: set model.path",
                              ("warm_start", "model.path"))  # fmt: skip
        return self

    @property
    def max_tokens(self) -> int:
        return self.orchestrator.max_tokens or self.env.max_tokens


def load_rl_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLRunConfig:
    """Read an RL run config (TOML; None: all defaults) and apply `--section.field=value` overrides."""
    return load_run_config(path, overrides, cls=RLRunConfig)
