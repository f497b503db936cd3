"""The run config of `flashnext train`: pydantic models read from TOML, overridable from the command line.

A run config is a TOML file whose tables are the sections below (`[model]`, `[data]`, `[optim]`, `[rl]`,
`[train]`, `[parallel]`, `[checkpoint]`, `[log]`); every field has a default, so an empty file trains the embedded
tiny model on the bundled corpus. `--section.field=value` on the command line overrides a field; the value is read
as a TOML literal (`--train.steps=20`, `--optim.betas=[0.9,0.99]`, `--model.path="ckpt"`) and falls back to a
plain string (`--model.path=ckpt`). Unknown keys and bad values raise one `ConfigError` naming every offending field
and where its value came from (the command-line override, the TOML file, or the default).
"""

from __future__ import annotations

import copy
import json
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flashnext.errors import ConfigError, FieldsError
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
    """Parameter dtype (and of the optimizer states); with `train.compute_dtype = "bfloat16"` keep it `float32`:
    the parameters are then the fp32 master weights of a bf16-compute run."""
    tokenizer: str | None = None
    """Tokenizer directory (`tokenizer.json` + `tokenizer_config.json`); None: the checkpoint's own when it has
    one, else the bundled tiny tokenizer."""
    freeze_ngram: bool = False
    """Freeze the PLE n-gram tables (the RL recipe's choice): no gradient, no optimizer state, and from a checkpoint
    kept in their stored dtype (FP8 + scale, BF16, ...) or read from the files (`ngram_storage = "mmap"`)."""
    ngram_storage: Literal["auto", "dense", "stored", "mmap", "nf4"] = "auto"
    """How a checkpoint's n-gram tables are held (`from_pretrained`): `auto` is `stored` when frozen, else `dense`
    (trainable, in `dtype`; FP8 tables are upcast one shard at a time while loading); `stored`, `mmap` and `nf4`
    (4-bit rows quantised at load, lossy) need `freeze_ngram`."""
    ngram_resident_mb: float = Field(256, ge=0)
    """With `ngram_storage = "mmap"`: MiB of n-gram rows cached in memory per table."""

    @model_validator(mode="after")
    def _no_overrides_with_path(self) -> ModelSection:
        if self.path is not None and self.overrides:
            raise FieldsError(
                "overrides apply to a randomly initialised model; they cannot change the checkpoint at path",
                ("overrides", "path"),
            )
        frozen_only = ("stored", "mmap", "nf4")
        if self.ngram_storage in frozen_only and not self.freeze_ngram:
            raise FieldsError(
                f"ngram_storage={self.ngram_storage!r} keeps the tables frozen: set freeze_ngram = true",
                ("ngram_storage", "freeze_ngram"),
            )
        if self.ngram_storage in frozen_only and self.path is None:
            raise FieldsError(
                f"ngram_storage={self.ngram_storage!r} reads a checkpoint's tables: set model.path",
                ("ngram_storage", "path"),
            )
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
    eval_fraction: float = Field(0.0, ge=0, lt=1)
    """Hold out this fraction of `path`'s examples (at least one; a fixed split drawn from `seed`) for the eval
    loss; 0: no held-out split from `path`."""
    eval_path: str | None = None
    """A separate JSONL file of held-out examples for the eval loss (instead of `eval_fraction`)."""
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed line (bad JSON or ids; for image rows also a missing or undecodable image, or more tokens than
    `token_budget`): `error` stops the run naming file and line; `skip` warns with file and line and leaves it out."""
    image_min_pixels: int | None = Field(None, ge=1)
    """Image rows: the processor resizes each image to at least this many pixels (None: its default, 56 x 56)."""
    image_max_pixels: int | None = Field(None, ge=1)
    """Image rows: ... and at most this many (None: its default, 28 x 28 x 1280); fewer pixels, fewer tokens."""

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataSection:
        if self.eval_fraction and self.eval_path is not None:
            raise FieldsError(
                "give one held-out split: eval_fraction or eval_path, not both", ("eval_fraction", "eval_path")
            )
        return self


class TrainSection(BaseModel):
    """The training loop."""

    model_config = _STRICT

    steps: int = Field(100, ge=1)
    """Optimizer steps to run (in total, counting the steps of a resumed checkpoint); at least 1."""
    loss: Literal["sft", "rl"] = "sft"
    """`sft`: cross-entropy on label tokens; `rl`: the importance-weighted policy loss (needs RL data)."""
    mtp_loss_weight: float = Field(0.0, ge=0)
    """Weight of the MTP head's next-next-token loss added to the step's loss (0: the head is not trained);
    needs a model with an MTP head (`mtp_num_hidden_layers` in its config)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (non-reentrant) instead of keeping its activations."""
    compile: bool = False
    """torch.compile each decoder layer (packed counts and token totals stay dynamic)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Dtype of forward and backward; `auto` (resolved when the config is read) is `model.dtype`. `bfloat16` with
    `model.dtype = "float32"`: bf16 compute over fp32 master weights, fp32 gradient accumulation and optimizer
    states (`train.precision`). Under torchrun on CUDA, FSDP2's mixed precision applies instead (bf16 by
    default)."""
    device: str = "cpu"
    """`cpu`, `cuda`, `cuda:N` or `auto` (CUDA when available)."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch (0: torch's default)."""
    flush_denormals: bool = True
    """CPU: floats below 2^-126 (~1.2e-38) read and written as zero on the trainer's threads (x86 FTZ/DAZ,
    `flashnext.denormals`): a Gated DeltaNet chunk's decays make such values, and every instruction touching one
    is slow (fwd+bwd 1.25x faster in fp32, 1.54x in bf16 on a Xeon); `false` keeps IEEE denormals."""
    seed: int = 0
    """Seed of torch's global RNG (nothing in a step draws from it today; kept for exact resume)."""
    eval_every: int = Field(0, ge=0)
    """Compute the held-out loss (`eval_loss`; needs `data.eval_fraction` or `data.eval_path`) every N steps and
    after the last; 0: after the last step only."""
    ignore_memory_plan: bool = False
    """Build or load the model even when the memory plan (printed first: weights, gradients, optimizer
    state; `train/memory_plan.py`) says it cannot fit this machine's RAM or GPU."""
    overwrite: bool = False
    """Start over in an `out_dir` that holds a previous run: delete its `metrics.jsonl`, `checkpoints/`,
    `final/` and `plots/` first (without it, and without `--resume`, such an `out_dir` is refused)."""


class ParallelSection(BaseModel):
    """How the ranks of a `torchrun` launch share the work (FSDP2 always shards over every rank)."""

    model_config = _STRICT

    cp: int = Field(1, ge=1)
    """Context parallelism: ranks that split each micro-batch's token stream (a long sequence spans them). Must
    divide the world size; the `world / cp` groups take different micro-batches. Text models, no `train.compile`."""


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
    parallel: ParallelSection = ParallelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()

    @model_validator(mode="after")
    def _schedule_length(self) -> RunConfig:
        # The lr schedule spans the run unless `optim.total_steps` is given explicitly.
        if "total_steps" not in self.optim.model_fields_set:
            if self.optim.warmup_steps > self.train.steps:
                raise FieldsError(
                    f"optim.warmup_steps={self.optim.warmup_steps} exceeds train.steps={self.train.steps}, the "
                    "length of the lr schedule; lower optim.warmup_steps, raise train.steps, or set optim.total_steps",
                    ("optim.warmup_steps", "train.steps"),
                )
            fields = self.optim.model_dump(exclude={"total_steps"})
            self.optim = OptimConfig.model_validate({**fields, "total_steps": self.train.steps})
        if self.train.compute_dtype == "auto":
            self.train = self.train.model_copy(update={"compute_dtype": self.model.dtype})
        if self.train.compute_dtype == "float32" and self.model.dtype == "bfloat16":
            raise FieldsError(
                "train.compute_dtype='float32' needs fp32 parameters: set model.dtype='float32' (fp32 throughout) or "
                "train.compute_dtype='bfloat16'",
                ("train.compute_dtype", "model.dtype"),
            )
        if self.checkpoint.resume == "latest" and self.train.overwrite:
            raise FieldsError(
                "train.overwrite=true deletes the checkpoints that checkpoint.resume='latest' would continue from; "
                "give one of them",
                ("train.overwrite", "checkpoint.resume"),
            )
        return self

    @model_validator(mode="after")
    def _eval_source(self) -> RunConfig:
        # Named so that a run config with other evaluation rules (`flashnext rl`'s) can replace this one.
        if self.train.eval_every and not (self.data.eval_fraction or self.data.eval_path is not None):
            raise FieldsError(
                f"train.eval_every={self.train.eval_every} needs a held-out split: set data.eval_fraction or "
                "data.eval_path",
                ("train.eval_every", "data.eval_fraction", "data.eval_path"),
            )
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


class Origins:
    """Where each value of a run config came from: a command-line override, the TOML file, or the default.

    Args:
        file: the TOML file's path (None: no file).
        file_data: the file's parsed tables (before overrides are applied).
        overrides: the `--section.field=value` arguments, in order (a later one wins).
    """

    def __init__(self, file: str | None = None, file_data: dict | None = None, overrides: list[str] | None = None):
        self.file, self.file_data, self.overrides = file, file_data or {}, list(overrides or [])

    def of(self, loc: tuple) -> str:
        """Where the value at `loc` (e.g. `("train", "steps")`) came from, as a phrase."""
        loc = tuple(str(p) for p in loc)
        for arg in reversed(self.overrides):
            keys = tuple(parse_override(arg)[0])
            n = min(len(keys), len(loc))
            if keys[:n] == loc[:n]:  # the override set this value, a section holding it, or a field inside it
                return f"from {arg} on the command line"
        node: Any = self.file_data
        for key in loc:
            if not isinstance(node, dict) or key not in node:
                return "the default"
            node = node[key]
        return f"from {self.file}"


def run_config_from_dict(
    data: dict[str, Any], origins: Origins | str | None = None, cls: type[RunConfig] = RunConfig
) -> RunConfig:
    """Validate a nested dict as `cls` (a `RunConfig` or an extension of it, e.g. the RL run config); every problem
    is reported in one `ConfigError` as `section.field: message (got value, from where)`, a problem with a
    combination of fields naming where each of them came from."""
    origins = origins if isinstance(origins, Origins) else Origins(file=origins, file_data=data)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        lines = [_problem(err, origins) for err in e.errors()]
        raise ConfigError("invalid run config: " + "; ".join(lines) + _other_command_hint(origins, cls)) from None


RL_KEYS = ("warm_start", "orchestrator", "env", "inference")  # what only an RL run config (`flashnext rl`) has


def _other_command_hint(origins: Origins, cls: type[RunConfig]) -> str:
    """When a run config meant for the other command fails: which command runs it."""
    if origins.file is None:
        return ""
    rl_keys = [k for k in RL_KEYS if k in origins.file_data]
    is_rl = set(RL_KEYS) <= set(cls.model_fields)
    if rl_keys and not is_rl:
        return f"; {origins.file} is an RL run config ({', '.join(rl_keys)}): run it with flashnext rl --config"
    if not rl_keys and is_rl and "data" in origins.file_data:
        return (f"; {origins.file} has a [data] section and none of the RL ones ({', '.join(RL_KEYS)}): if it is an "
                "SFT run config, run it with flashnext train --config")  # fmt: skip
    return ""


def _problem(err: dict, origins: Origins) -> str:
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc) or "(top level)"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldsError):  # a rule over several fields: name where each one came from
        fields = [tuple(str(p) for p in loc) + tuple(f.split(".")) for f in cause.fields]
        sources = "; ".join(f"{'.'.join(f)} {origins.of(f)}" for f in fields)
        prefix = f"{where}: " if loc else ""
        return f"{prefix}{cause} ({sources})"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key ({origins.of(loc)})"
    msg = err["msg"].removeprefix("Value error, ")  # a validator's own message: pydantic's prefix adds nothing
    return f"{where}: {msg} (got {err.get('input')!r}, {origins.of(loc)})"


def load_run_config(
    path: str | Path | None = None, overrides: list[str] | None = None, cls: type[RunConfig] = RunConfig
) -> RunConfig:
    """Read a TOML run config (None: all defaults) as `cls` and apply command-line overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"run config {path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"run config {path} is a directory; --config takes a TOML file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
    origins = Origins(None if path is None else str(path), copy.deepcopy(data), overrides)
    apply_overrides(data, list(overrides or []))
    _drop_other_envs_args(data, origins)
    return run_config_from_dict(data, origins, cls)


def _drop_other_envs_args(data: dict[str, Any], origins: Origins) -> None:
    """An RL recipe's `env.args` belong to its `env.name`: when the command line names another environment and
    leaves the args to the file, they are not passed to it (a note on stderr says so)."""
    env, file_env = data.get("env"), origins.file_data.get("env")
    if not isinstance(env, dict) or not isinstance(file_env, dict) or "args" not in env:
        return
    named_here = origins.of(("env", "name")).endswith("on the command line")
    args_from_file = origins.of(("env", "args")) == f"from {origins.file}"
    if named_here and args_from_file and env.get("name") != file_env.get("name", "reverse"):
        print(f"note: env.args from {origins.file} are for env {file_env.get('name', 'reverse')!r}, not passed to "
              f"{env.get('name')!r} (give its own with --env.args.KEY=VALUE)", file=sys.stderr)  # fmt: skip
        del env["args"]
