"""Model + tokenizer for serving: a checkpoint directory, or the embedded tiny default (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashnext.config import tiny_config

DEFAULT_SEED = 0
DEFAULT_NAME = "flashnext-tiny"


def load_for_serving(model_dir: str | Path | None, dtype: torch.dtype = torch.float32, seed: int = DEFAULT_SEED):
    """(model, tokenizer or None, model name).

    Without `model_dir`: the tiny default config (`flashnext/configs/tiny.json`) with random weights from `seed`
    and the bundled tokenizer. With it: `from_pretrained(model_dir)` and the tokenizer files found there (None if
    the checkpoint ships none: prompts must then be token ids).
    """
    from flashnext.build import build_model, from_pretrained
    from flashnext.tokenizer import TOKENIZER_FILE, load_tokenizer

    if model_dir is None:
        return build_model(tiny_config(), seed=seed, dtype=dtype), load_tokenizer(), DEFAULT_NAME
    path = Path(model_dir)
    model = from_pretrained(path, dtype=dtype, device="cpu")
    tokenizer = load_tokenizer(path) if (path / TOKENIZER_FILE).exists() else None
    return model, tokenizer, path.resolve().name
