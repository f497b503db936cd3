"""The one place models are built: from a checkpoint (`from_pretrained`) or from a config with a seeded random init
(`build_model`). The CLI, the trainer and the server all call these.

Both build on the meta device, cast there (free), allocate once in the final dtype/device with `to_empty`, recompute
the derived buffers, then fill the weights (streamed from the checkpoint, or drawn by `init_weights(seed)`), so no
parameter is ever materialised twice.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from flashnext.checkpoint.files import checkpoint_files, read_headers
from flashnext.checkpoint.fp8_weights import fp8_expert_layers
from flashnext.checkpoint.int_weights import int_scheme
from flashnext.checkpoint.load import load_checkpoint
from flashnext.config import ModelConfig, TextConfig, load_config
from flashnext.errors import CheckpointError
from flashnext.model.multimodal import on_meta
from flashnext.model.quant_experts_fp8 import use_fp8_experts
from flashnext.ngram import DEFAULT_RESIDENT_MB, fill_quantized_tables, prepare_ngram_storage
from flashnext.quant.int_checkpoint import fill_int_modules, use_int_modules

log = logging.getLogger("flashnext")


def build_model(
    config: TextConfig | ModelConfig,
    *,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """A model of `config` (a composite `ModelConfig` with a vision tower gives the composite model).

    Args:
        config: the model config.
        seed: random init (`init_weights(seed)`, deterministic in the seed); None leaves the weights unset
            (allocated, not initialised: for a caller that fills them, e.g. `load_state_dict`).
        dtype: floating-point dtype of the parameters.
        device: where the parameters live; "meta" returns the model unallocated (for `parallelize`, which
            materialises only the local shards).

    Returns:
        The model in eval mode.
    """
    model = on_meta(config, dtype)
    if torch.device(device).type != "meta":
        _materialise(model, device, seed)
    return model.eval()


def _materialise(model: nn.Module, device: str | torch.device, seed: int | None = None) -> None:
    """Allocate a meta model once on `device`, recompute its derived buffers, and init it when `seed` is given."""
    model.to_empty(device=device)
    model.reset_buffers()
    if seed is not None:
        model.init_weights(seed)


def from_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    ngram_storage: str = "auto",
    ngram_resident_mb: float = DEFAULT_RESIDENT_MB,
) -> torch.nn.Module:
    """Load a checkpoint: `FlashNextForConditionalGeneration` for a composite (`qwen4_exp`) one with a vision tower,
    `FlashNextForCausalLM` for a text (`qwen4_exp_text`) one or a composite one with `language_model_only: true`
    or no `vision_config` (its `model.visual.*` tensors, if any, are kept in `extra_tensors`).

    The model is built on `meta`, cast to `dtype` there (free), allocated once with `to_empty(device=...)`,
    its derived buffers recomputed (`reset_buffers()`), then every weight is copied in place; no parameter is
    ever materialised twice. Only floating-point tensors take `dtype`; integer buffers keep theirs.

    Args:
        path: checkpoint directory (`config.json` + `model.safetensors` or shards with an index).
        dtype: floating-point dtype of the parameters.
        device: where the parameters live.
        ngram_storage: how the PLE n-gram tables are held (`flashnext.ngram.storage`): `auto` (FP8
            tables stay FP8 and frozen, others are trainable `nn.Embedding`s in `dtype`), `dense` (all in `dtype`,
            FP8 upcast shard by shard), `stored` (all frozen in their stored dtype) or `mmap` (rows read from the
            files on lookup, `ngram/ondisk.py`) or `nf4` (4-bit rows quantised at load, lossy, `ngram/nf4.py`).
        ngram_resident_mb: with `mmap`, MiB of recently read rows cached in memory per table (0: none).

    Returns:
        The model in eval mode, with `model.model_config` (the parsed `ModelConfig`, so `save_pretrained`
        writes the same layout back), `model.extra_tensors` and `model.checkpoint_style` set.

    Raises:
        ConfigError: invalid `config.json`.
        CheckpointError: missing/unexpected/mis-shaped/wrong-dtype keys or unreadable files, all listed.
    """
    cfg = load_config(path)
    multimodal = cfg.vision_config is not None
    model = on_meta(cfg, dtype)
    style = "multimodal" if multimodal else "composite" if cfg.composite else "text"
    prepare_ngram_storage(model, path, ngram_storage, dtype=dtype, style=style, resident_mb=ngram_resident_mb)
    int_q = int_scheme(cfg)  # an int8/int4 checkpoint (`checkpoint/int_weights.py`), else None
    if int_q is None and (fp8_layers := fp8_expert_layers(path, cfg, style)):  # the official FP8 checkpoint
        use_fp8_experts(model, fp8_layers, dtype)
    if model.mtp is not None and not _stores_mtp(path):
        # The config declares an MTP head but the checkpoint has none (converters that drop `mtp.*` keep the
        # config): load the trunk without a draft head rather than refuse the checkpoint.
        log.warning("%s: config.json declares an MTP layer but no mtp.* weights are stored; loaded without it", path)
        model.mtp = None
    if int_q is not None:  # its quantized modules built as such on meta (no float copy), filled after the rest
        int_q = use_int_modules(model, path, int_q, style, dtype, device)
    _materialise(model, device)
    model.model_config = cfg
    skip = {} if int_q is None else {"skip_ours": int_q.skip_ours, "skip_disk": int_q.skip_disk}
    _load_weights(model, path, style, skip)
    fill_quantized_tables(model)  # ngram_storage="nf4": quantised from the files, shard by shard
    if int_q is not None:
        fill_int_modules(model, int_q)
    return model.eval()


def _load_weights(model: torch.nn.Module, path: str | Path, style: str, skip: dict) -> None:
    """`load_checkpoint`, saying what a composite checkpoint without its vision tower should declare."""
    try:
        load_checkpoint(model, path, prefix_style=style, **skip)
    except CheckpointError as e:
        if style == "multimodal" and e.problems and all(x.startswith("missing: model.visual.") for x in e.problems):
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no vision tower weights but its config.json has a vision_config; "
                "a text-only composite checkpoint sets `language_model_only: true`",
                e.problems,
            ) from None
        raise


def _stores_mtp(path: str | Path) -> bool:
    """Whether a checkpoint holds any `mtp.*` tensor (header read only; unreadable files are load's to report)."""
    files, weight_map = checkpoint_files(path)
    if weight_map is not None:
        return any(k.startswith("mtp.") for k in weight_map)
    headers, _, _ = read_headers(files, weight_map)
    return any(k.startswith("mtp.") for k in headers)
