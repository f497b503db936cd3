"""The run config of `flashnext train`: pydantic models read from TOML, overridable from the command line.

A run config is a TOML file whose tables are the sections below (`[model]`, `[data]`, `[optim]`, `[rl]`,
`[train]`, `[checkpoint]`, `[log]`); every field has a default, so an empty file trains the embedded tiny model
on the bundled corpus. `--section.field=value` on the command line overrides a field; the value is read as a TOML
literal (`--train.steps=20`, `--optim.betas=[0.9,0.99]`, `--model.path="ckpt"`) and falls back to a plain string
(`--model.path=ckpt`). Unknown keys and bad values raise one `ConfigError` naming every offending field.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flashnext.errors import ConfigError
from flashnext.train.loss import RLLossConfig
from flashnext.train.optim import OptimConfig

_STRICT = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelSection(BaseModel):
    """Which model to train."""

    model_config = _STRICT

    path: str | None = None
    """Checkpoint directory in the official layout to start from; None builds a randomly initialised model."""
    config: str = "tiny"
    """Without `path`: `tiny` (the embedded default) or a config.json / checkpoint directory to build from."""
    overrides: dict[str, Any] = {}
    """Config fields replaced before the model is built (e.g. `{num_hidden_layers = 2}`); random init only."""
    seed: int = 0
    """Seed of the random initialisation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""
    tokenizer: str | None = None
    """Tokenizer directory (`tokenizer.json` + `tokenizer_config.json`); None: the checkpoint's own when it has
    one, else the bundled tiny tokenizer."""

    @model_validator(mode="after")
    def _no_overrides_with_path(self) -> ModelSection:
        if self.path is not None and self.overrides:
            raise ValueError("overrides apply to a randomly initialised model; they cannot change a checkpoint")
        return self


class DataSection(BaseModel):
    """Training data and how it is packed."""

    model_config = _STRICT

    path: str | None = None
    """JSONL dataset (prompt/completion, messages or pre-tokenized lines); None: the bundled tiny SFT corpus."""
    token_budget: int = Field(1024, ge=1)
    """Most tokens in one packed micro-batch."""
    micro_batches: int = Field(1, ge=1)
    """Micro-batches per optimizer step on each rank (gradient accumulation)."""
    seed: int = 0
    """Seed of the example order (each epoch reshuffles with `(seed, epoch)`)."""
    balance: bool = True
    """Balance the micro-batches of a step by estimated FLOPs (False: next-fit in shuffled order)."""
    truncate: bool = False
    """Cut examples longer than `token_budget` (with a warning) instead of failing."""
    add_eos: bool = True
    """Append the tokenizer's EOS to prompt/completion examples."""


class TrainSection(BaseModel):
    """The training loop."""

    model_config = _STRICT

    steps: int = Field(100, ge=0)
    """Optimizer steps to run (in total, counting the steps of a resumed checkpoint)."""
    loss: Literal["sft", "rl"] = "sft"
    """`sft`: cross-entropy on label tokens; `rl`: the importance-weighted policy loss (needs RL data)."""
    mtp_loss_weight: float = Field(0.0, ge=0)
    """Weight of the MTP head's next-next-token loss added to the step's loss (0: the head is not trained);
    needs a model with an MTP head (`mtp_num_hidden_layers` in its config)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (non-reentrant) instead of keeping its activations."""
    compile: bool = False
    """torch.compile each decoder layer (packed counts and token totals stay dynamic)."""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto` (CUDA when available)."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch (0: torch's default)."""
    seed: int = 0
    """Seed of torch's global RNG (nothing in a step draws from it today; kept for exact resume)."""


class CheckpointSection(BaseModel):
    """Training checkpoints (model, optimizer, scheduler, data position, RNG) and the final export."""

    model_config = _STRICT

    every: int = Field(0, ge=0)
    """Save every N steps (0: only at the end of the run)."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a new one is safely in place."""
    resume: str | None = None
    """`latest` (the newest checkpoint in `<out_dir>/checkpoints`, if any) or a checkpoint directory."""
    export: bool = True
    """Write the final model in the official Hugging Face layout to `<out_dir>/final`."""


class LogSection(BaseModel):
    """Progress and metrics."""

    model_config = _STRICT

    every: int = Field(1, ge=1)
    """Log metrics every N steps."""
    progress: bool = True
    """Show a progress bar (loss, lr, tokens/s) on stderr."""
    peak_flops: float | Literal["measure"] = "measure"
    """Peak FLOP/s of one device for MFU; `measure` times a large fp32/bf16 matmul at start-up."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs `wandb` installed)."""


class RunConfig(BaseModel):
    """A training run."""

    model_config = _STRICT

    out_dir: str = "runs/tiny-sft"
    """Run directory: `metrics.jsonl`, `checkpoints/`, `final/`."""
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optim: OptimConfig = OptimConfig()
    rl: RLLossConfig = RLLossConfig()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()

    @model_validator(mode="after")
    def _schedule_length(self) -> RunConfig:
        # The lr schedule spans the run unless `optim.total_steps` is given explicitly.
        if "total_steps" not in self.optim.model_fields_set:
            fields = self.optim.model_dump(exclude={"total_steps"})
            self.optim = OptimConfig.model_validate({**fields, "total_steps": max(1, self.train.steps)})
        return self


def toml_literal(value: Any) -> str:
    """`value` (dict, list, str, number, bool) as a TOML literal, dicts as inline tables: the inverse of the
    parsing of `--section.field=value`, e.g. `--model.overrides=` + `toml_literal({"hidden_size": 64})`."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)


def parse_override(arg: str) -> tuple[list[str], Any]:
    """`--a.b=value` (or `a.b=value`) -> (["a", "b"], value read as a TOML literal, else the raw string)."""
    body = arg[2:] if arg.startswith("--") else arg
    key, sep, raw = body.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {arg!r} must look like --section.field=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `--section.field=value` in the nested dict `data` (in place) and return it."""
    for arg in overrides:
        keys, value = parse_override(arg)
        node = data
        for k in keys[:-1]:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {arg!r}: {k!r} is a value, not a section")
            node = child
        node[keys[-1]] = value
    return data


def run_config_from_dict(data: dict[str, Any], source: str = "run config") -> RunConfig:
    """Validate a nested dict; every problem is reported in one `ConfigError` as `section.field: message`."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            if err["type"] == "extra_forbidden":
                lines.append(f"{where}: unknown key")
            else:
                lines.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        raise ConfigError(f"{source}: " + "; ".join(lines)) from None


def load_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run config (None: all defaults) and apply command-line overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"run config {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
    apply_overrides(data, list(overrides or []))
    return run_config_from_dict(data, source)
