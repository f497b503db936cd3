"""`from_pretrained`: build the model on the meta device, allocate it once in its final dtype, stream weights in."""

from __future__ import annotations

from pathlib import Path

import torch

from flashnext.checkpoint.load import load_checkpoint
from flashnext.config import load_config


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """Load a text (`qwen4_exp_text`) or composite (`qwen4_exp`) checkpoint into `FlashNextForCausalLM`.

    The model is built on `meta`, cast to `dtype` there (free), allocated once with `to_empty(device=...)`,
    its derived buffers recomputed (`reset_buffers()`), then every weight is copied in place; no parameter is
    ever materialised twice. Only floating-point tensors take `dtype`; integer buffers keep theirs.

    Args:
        path: checkpoint directory (`config.json` + `model.safetensors` or shards with an index).
        dtype: floating-point dtype of the parameters.
        device: where the parameters live.

    Returns:
        The model in eval mode, with `model.model_config` (the parsed `ModelConfig`, so `save_pretrained`
        writes the same layout back), `model.extra_tensors` and `model.checkpoint_style` set.

    Raises:
        ConfigError: invalid `config.json`.
        CheckpointError: missing/unexpected/mis-shaped/wrong-dtype keys or unreadable files, all listed.
    """
    from flashnext.model.text import FlashNextForCausalLM  # deferred: keeps `import flashnext` cheap

    cfg = load_config(path)
    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg.text)
    model.to(dtype=dtype)
    model.to_empty(device=device)
    model.reset_buffers()
    model.model_config = cfg
    load_checkpoint(model, path, prefix_style="composite" if cfg.composite else "text")
    return model.eval()
