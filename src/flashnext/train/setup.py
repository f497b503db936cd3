"""What a training run is built from: the device, the model (built, or loaded and maybe frozen), its tokenizer and
its examples (train and held-out), each checked against the model before step 1; the seeds, the context-parallel
group, compile and activation checkpointing, the optimizers and mixed precision.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

import torch

from flashnext.config import TextConfig, load_config, parse_config, tiny_config_dict
from flashnext.denormals import flush_denormals
from flashnext.errors import CheckpointError, ConfigError, InputError
from flashnext.model import fused
from flashnext.parallel.dist import DistContext
from flashnext.train.config import RunConfig
from flashnext.train.data import Example, ModelLimits, load_jsonl
from flashnext.train.evaluation import split_eval
from flashnext.train.memory_plan import check_training_plan
from flashnext.train.optim import Schedulers, build_optimizer
from flashnext.train.precision import MixedPrecision

log = logging.getLogger("flashnext.train")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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


def check_model_path(path: str) -> None:
    """`ConfigError` naming `model.path` unless it is a model directory (config.json + weights), saying what it is."""
    from flashnext.serve.loading import check_model_dir

    try:
        check_model_dir(Path(path))
    except CheckpointError as e:
        raise ConfigError(f"model.path={path!r}: {e}") from None


def model_text_config(cfg: RunConfig) -> TextConfig:
    """The text config the run builds (from the checkpoint, the named config, or the embedded tiny default)."""
    section = cfg.model
    if section.path is not None:
        check_model_path(section.path)
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

    dtype = DTYPES[cfg.model.dtype]
    distributed = ctx is not None and ctx.distributed
    if not distributed:  # under torchrun every rank holds a shard: the one-process plan does not apply
        check_training_plan(cfg, _model_config(cfg), device)
    if cfg.model.path is not None:
        check_model_path(cfg.model.path)
        storage = cfg.model.ngram_storage
        if storage == "auto":  # frozen: as stored (FP8 stays FP8); trainable: in `dtype`, FP8 upcast per shard
            storage = "stored" if cfg.model.freeze_ngram else "dense"
        model = build.from_pretrained(
            cfg.model.path, dtype=dtype, device="cpu" if distributed else device, ngram_storage=storage,
            ngram_resident_mb=cfg.model.ngram_resident_mb,
        )  # fmt: skip
    else:  # distributed: on meta, materialised shard by shard by parallelize
        model = build.build_model(
            _model_config(cfg), seed=cfg.model.seed, dtype=dtype, device="meta" if distributed else device
        )
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


def _model_config(cfg: RunConfig):
    """The whole model config of the run (the composite wrapper included when loading a composite checkpoint)."""
    from flashnext.config import ModelConfig

    if cfg.model.path is None:  # a composite config file (model.config) builds the composite model
        text = model_text_config(cfg)
        source = cfg.model.config
        full = load_config(source) if source != "tiny" and Path(source).exists() else None
        return dataclasses.replace(full, text=text) if full is not None and full.composite else ModelConfig(text=text)
    check_model_path(cfg.model.path)
    return load_config(cfg.model.path)


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
    cfg: RunConfig, tokenizer, limits: ModelLimits | None = None, model_config=None
) -> tuple[list[Example], list[Example] | None]:
    """(training examples, held-out examples or None) as `data` says; every id checked against `limits`; image
    rows need `model_config` (a composite model's `ModelConfig`)."""
    if cfg.data.path is not None:
        path = Path(cfg.data.path)
    else:
        from flashnext.tokenizer import bundled_sft_path

        path = bundled_sft_path()
    examples = _read_examples(path, "data.path", cfg, tokenizer, limits, model_config)
    if cfg.data.eval_path is not None:
        held_out = _read_examples(Path(cfg.data.eval_path), "data.eval_path", cfg, tokenizer, limits, model_config)
        return examples, held_out
    if cfg.data.eval_fraction:
        return split_eval(examples, cfg.data.eval_fraction, cfg.data.seed)
    return examples, None


def _read_examples(
    path: Path, field: str, cfg: RunConfig, tokenizer, limits: ModelLimits | None, model_config=None
) -> list[Example]:
    from flashnext.train.images import ImageRows

    if not path.is_file():
        problem = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
        raise ConfigError(f"{field}={str(path)!r} {problem}")
    d = cfg.data
    images = None
    if model_config is not None and getattr(model_config, "vision_config", None) is not None:
        images = ImageRows(model_config, path.parent, d.token_budget, d.image_min_pixels, d.image_max_pixels)
    examples = load_jsonl(path, tokenizer, d.add_eos, limits, images, skip_bad=d.bad_rows == "skip")
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


def seed_threads(cfg: RunConfig) -> None:
    """Threads (their denormal mode after their count) and the torch/python seeds of the run (the data order has
    its own seed)."""
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    flush_denormals(cfg.train.flush_denormals)
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)


def check_vocab(tokenizer, text_config: TextConfig) -> None:
    if tokenizer is not None and tokenizer.vocab_size > text_config.vocab_size:
        raise ConfigError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {text_config.vocab_size}"
        )


def context_group_of(cfg: RunConfig, ctx: DistContext, model: torch.nn.Module):
    """`parallel.cp > 1`: this rank's CP group (`parallel.context`), whose ranks split each micro-batch; else None."""
    cp = cfg.parallel.cp
    if cp == 1:
        return None
    from flashnext.model.text import FlashNextForCausalLM
    from flashnext.parallel.context import context_group

    if not ctx.distributed or cfg.train.compile or not isinstance(model, FlashNextForCausalLM):
        raise ConfigError(f"parallel.cp={cp} needs a torchrun launch, a text model and train.compile=false")
    text = model.config
    ratio = text.indexer_compress_ratio if text.qsa_enabled else 1
    return context_group(ctx.rank, ctx.world_size, cp, ratio)


def wrap_model(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Compile, then activation checkpointing, in one process (under torchrun `parallelize` applies both)."""
    if cfg.train.compile:
        from flashnext.compile import compile_model

        compile_model(model)  # before checkpointing: it compiles the plain layers
    if cfg.train.activation_checkpointing:
        from flashnext.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model)


def build_optimizers(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext) -> tuple[dict, list, Schedulers]:
    """(optimizers, param groups, schedule): Muon / per-expert Muon / AdamW groups, shard-aware under FSDP2."""
    optimizers, param_groups = build_optimizer(model, cfg.optim)
    if ctx.distributed:
        from flashnext.parallel import shard_aware_optimizers

        shard_aware_optimizers(optimizers)  # Muon orthogonalises whole matrices, not FSDP shards
    return optimizers, param_groups, Schedulers(optimizers, cfg.optim)


def mixed_precision(model: torch.nn.Module, cfg: RunConfig, ctx: DistContext, device: torch.device):
    """bf16 compute copies over the fp32 parameters (`train.compute_dtype`) in a single process (a
    `MixedPrecision`), or None. Warns when bf16 compute runs on a CPU without bf16 instructions."""
    compute = DTYPES[cfg.train.compute_dtype]
    if device.type == "cpu" and not fused.NATIVE_GEMM.get(compute, True):
        log.warning(
            "train.compute_dtype=%r on a CPU without bf16 instructions (no AVX512-BF16 or AMX): its matrix "
            "products are emulated there, several times slower than float32 (a 32 x 256 by 256 x 1024 product "
            "~9x on an AVX2 EPYC); train.compute_dtype='float32' trains faster on this machine",
            cfg.train.compute_dtype,
        )
    if cfg.train.compute_dtype == cfg.model.dtype:
        return None  # fp32 throughout, or bf16 parameters throughout
    if ctx.distributed:
        if device.type == "cuda":
            return None  # FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 sharded masters (`parallelize`)
        raise ConfigError(
            "train.compute_dtype='bfloat16' with fp32 parameters is not supported under torchrun on CPU "
            "(FSDP2's bf16 policy is enabled on CUDA only); use model.dtype='bfloat16' or compute in float32"
        )
    return MixedPrecision(model, compute)
