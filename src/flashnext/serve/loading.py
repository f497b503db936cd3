"""Model + tokenizer for serving: a checkpoint directory, or the embedded tiny default (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

DEFAULT_SEED = 0
DEFAULT_NAME = "flashnext-tiny"


def load_for_serving(
    model_dir: str | Path | None,
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    *,
    ngram_storage: str = "auto",
    ngram_resident_mb: float | None = None,
):
    """(model, tokenizer or None, model name).

    Without `model_dir`: the tiny default config (`flashnext/configs/tiny.json`) with random weights from `seed`
    and the bundled tokenizer. With it: `from_pretrained(model_dir)` and the tokenizer files found there (None if
    the checkpoint ships none: prompts must then be token ids). `ngram_storage` / `ngram_resident_mb` are
    `from_pretrained`'s (how the n-gram tables are held); the tiny default has no files, so only `auto`/`dense`.
    """
    from flashnext.tokenizer import TOKENIZER_FILE, load_tokenizer

    if model_dir is None:
        if ngram_storage not in ("auto", "dense"):
            from flashnext.errors import ConfigError

            raise ConfigError(f"--ngram-storage {ngram_storage} needs a checkpoint (--model DIR)")
        from flashnext.cli import tiny_config
        from flashnext.model.text import FlashNextForCausalLM

        model = FlashNextForCausalLM(tiny_config())
        model.init_weights(seed)
        return model.to(dtype).eval(), load_tokenizer(), DEFAULT_NAME
    from flashnext import from_pretrained

    path = Path(model_dir)
    kwargs = {} if ngram_resident_mb is None else {"ngram_resident_mb": ngram_resident_mb}
    model = from_pretrained(path, dtype=dtype, device="cpu", ngram_storage=ngram_storage, **kwargs).eval()
    tokenizer = load_tokenizer(path) if (path / TOKENIZER_FILE).exists() else None
    return model, tokenizer, path.resolve().name
