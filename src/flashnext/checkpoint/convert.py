"""A training checkpoint (`checkpoints/step_N`: `state.pt` + `meta.json`) -> the official Hugging Face layout.

Tensor by tensor from the state dict, without building the model: the weights are written under their disk names
(`save.state_entries`), the n-gram hash buffers the layout stores are derived from the config (`ngram_hash`), and
the run's tokenizer files are copied beside them. `flashnext convert` calls `convert_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashnext.checkpoint import layout, training
from flashnext.checkpoint.save import DEFAULT_MAX_SHARD_BYTES, state_entries, write_checkpoint
from flashnext.checkpoint.target import check_target, writing
from flashnext.config import FULL_ATTENTION, INDEXED, ModelConfig, parse_config
from flashnext.errors import CheckpointError, ConfigError
from flashnext.ngram_hash import hash_constants


def ngram_buffers(cfg: ModelConfig, prefix: str) -> dict[str, torch.Tensor]:
    """The derived n-gram buffers of every PLE layer, by our names (`{prefix}layers.{L}.ple.ple_embedding.*`)."""
    text = cfg.text
    out = {}
    for ple_index, one_based in enumerate(text.ple_layer_ids):
        base = f"{prefix}layers.{one_based - 1}.ple.ple_embedding."
        values = hash_constants(text, ple_index)
        for name, v in zip(layout.DERIVED_BUFFERS, values, strict=True):
            out[base + name] = torch.tensor(v, dtype=torch.long)
    return out


def convert_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    layer_type_spelling: str | None = None,
) -> Path:
    """Write a single-process training checkpoint's model in the official layout (+ the run's tokenizer files).

    `out` must be absent or empty unless `overwrite`, which replaces it whole (`checkpoint.target`).
    `layer_type_spelling` (`full_attention` or `indexed_attention`) names the QSA layers in the written
    `config.json`'s `layer_types`; None keeps the spelling the run's model was loaded with.

    Raises:
        CheckpointError: the checkpoint is unreadable, holds no model state, or `out` is not empty.
    """
    here = Path(checkpoint).resolve()
    if Path(out).resolve() == here or Path(out).resolve() in here.parents:
        raise CheckpointError(f"convert: --out {str(out)!r} holds the checkpoint {str(checkpoint)!r}; choose another")
    check_target(out, overwrite)
    meta = training.load_meta(checkpoint)
    state = training.load(checkpoint).get("model")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{str(checkpoint)!r} holds no model state (state.pt has no 'model' entry)")
    cfg = parse_config(meta["model_config"])
    if layer_type_spelling is not None:
        if layer_type_spelling not in (INDEXED, FULL_ATTENTION):
            raise ConfigError(
                f"layer_type_spelling={layer_type_spelling!r}: expected {FULL_ATTENTION!r} or {INDEXED!r}"
            )
        cfg.text.layer_type_spelling = layer_type_spelling
    style = layout.model_style(state) or layout.TEXT
    prefix = "model.language_model." if style == layout.MULTIMODAL else "model."
    entries = state_entries(state, ngram_buffers(cfg, prefix), {}, style, cfg)
    with writing(out, overwrite) as tmp:
        write_checkpoint(tmp, entries, cfg, max_shard_bytes)
        _copy_tokenizer(meta.get("run_config", {}).get("model", {}), tmp)
    return Path(out)


def _copy_tokenizer(model_section: dict, out: Path) -> None:
    """The run's tokenizer (`model.tokenizer`, else the checkpoint it started from, else the bundled one), if any
    loads: a run on pre-tokenized data may have none."""
    from flashnext.tokenizer import TOKENIZER_FILE, load_tokenizer

    source = model_section.get("tokenizer")
    path = model_section.get("path")
    if source is None and path is not None and (Path(path) / TOKENIZER_FILE).exists():
        source = path
    try:
        load_tokenizer(source).save(out)
    except (ImportError, ConfigError, OSError):
        pass
