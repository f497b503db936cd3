"""`from_pretrained`: build the model on the meta device, allocate it once in its final dtype, stream weights in."""

from __future__ import annotations

from pathlib import Path

import torch

from flashnext.checkpoint.load import load_checkpoint
from flashnext.checkpoint.ngram_ondisk import DEFAULT_RESIDENT_MB
from flashnext.checkpoint.ngram_tables import fill_quantized_tables, prepare_ngram_storage
from flashnext.config import load_config
from flashnext.errors import CheckpointError


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
        ngram_storage: how the PLE n-gram tables are held (`flashnext.checkpoint.ngram_tables`): `auto` (FP8
            tables stay FP8 and frozen, others are trainable `nn.Embedding`s in `dtype`), `dense` (all in `dtype`,
            FP8 upcast shard by shard), `stored` (all frozen in their stored dtype) or `mmap` (rows read from the
            files on lookup, `checkpoint/ngram_ondisk.py`) or `nf4` (4-bit rows quantised at load, lossy,
            `model/ngram_nf4.py`).
        ngram_resident_mb: with `mmap`, MiB of recently read rows cached in memory per table (0: none).

    Returns:
        The model in eval mode, with `model.model_config` (the parsed `ModelConfig`, so `save_pretrained`
        writes the same layout back), `model.extra_tensors` and `model.checkpoint_style` set.

    Raises:
        ConfigError: invalid `config.json`.
        CheckpointError: missing/unexpected/mis-shaped/wrong-dtype keys or unreadable files, all listed.
    """
    from flashnext.model.multimodal import FlashNextForConditionalGeneration  # deferred: keeps `import flashnext` cheap
    from flashnext.model.text import FlashNextForCausalLM

    cfg = load_config(path)
    multimodal = cfg.vision_config is not None
    with torch.device("meta"):
        model = FlashNextForConditionalGeneration(cfg) if multimodal else FlashNextForCausalLM(cfg.text)
    model.to(dtype=dtype)
    style = "multimodal" if multimodal else "composite" if cfg.composite else "text"
    prepare_ngram_storage(model, path, ngram_storage, dtype=dtype, style=style, resident_mb=ngram_resident_mb)
    model.to_empty(device=device)
    model.reset_buffers()
    model.model_config = cfg
    try:
        load_checkpoint(model, path, prefix_style=style)
    except CheckpointError as e:
        if multimodal and e.problems and all(x.startswith("missing: model.visual.") for x in e.problems):
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no vision tower weights but its config.json has a vision_config; "
                "a text-only composite checkpoint sets `language_model_only: true`",
                e.problems,
            ) from None
        raise
    fill_quantized_tables(model)  # ngram_storage="nf4": quantised from the files, shard by shard
    return model.eval()
