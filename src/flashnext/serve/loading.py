"""Model + tokenizer for serving: a checkpoint directory, or the embedded tiny default (no downloads).

Also what serving needs to know about a tokenizer: the ids that end a chat turn, and how many bytes of text one
token can cover at most (so a prompt that certainly exceeds the context is refused before tokenizing it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashnext.config import tiny_config
from flashnext.errors import CheckpointError, ConfigError

DEFAULT_SEED = 0
DEFAULT_NAME = "flashnext-tiny"
END_OF_TURN = "<|im_end|>"  # ChatML: ends an assistant turn


def load_for_serving(
    model_dir: str | Path | None,
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
    *,
    ngram_storage: str = "auto",
    ngram_resident_mb: float | None = None,
    device: str | torch.device = "cpu",
    quant=None,
):
    """(model, tokenizer or None, model name), the model's parameters in `dtype` on `device`.

    Without `model_dir`: the tiny default config (`flashnext/configs/tiny.json`) with random weights from `seed`
    and the bundled tokenizer. With it: `from_pretrained(model_dir)` and the tokenizer files found there (None if
    the checkpoint ships none: prompts must then be token ids). `ngram_storage` / `ngram_resident_mb` are
    `from_pretrained`'s (how the n-gram tables are held); the tiny default has no files, so only `auto`/`dense`.
    `quant` (a `flashnext.quant.apply.QuantScheme`): the loaded model is quantized in memory, part by part.

    Raises:
        CheckpointError: `model_dir` does not exist, or is not a model directory (a training checkpoint or run
            directory gets a message saying how to serve it).
        ConfigError: an n-gram storage that needs files (`stored`, `mmap`) without `model_dir`.
    """
    from flashnext.build import build_model, from_pretrained
    from flashnext.tokenizer import TOKENIZER_FILE, load_tokenizer

    if model_dir is None:
        if ngram_storage not in ("auto", "dense"):
            raise ConfigError(f"--ngram-storage {ngram_storage} needs a checkpoint (--model DIR)")
        model = build_model(tiny_config(), seed=seed, dtype=dtype, device=device)
        return _quantized(model, quant), load_tokenizer(), DEFAULT_NAME
    path = Path(model_dir)
    check_model_dir(path)
    kwargs = {} if ngram_resident_mb is None else {"ngram_resident_mb": ngram_resident_mb}
    model = from_pretrained(path, dtype=dtype, device=device, ngram_storage=ngram_storage, **kwargs)
    tokenizer = load_tokenizer(path) if (path / TOKENIZER_FILE).exists() else None
    return _quantized(model, quant), tokenizer, served_name(path)


def _quantized(model, quant):
    """`model` quantized in place by the scheme `quant` (None or nothing enabled: as it is)."""
    if quant is None or not quant.enabled:
        return model
    from flashnext.quant.apply import quantize_model

    return quantize_model(model, quant)


def served_name(path: Path) -> str:
    """The model id a checkpoint directory is served as: its name, or for a run's export (`RUN/final`) the run's."""
    path = path.resolve()
    return path.parent.name if path.name == "final" and path.parent.name else path.name


def checkpoint_dtype(model_dir: str | Path | None) -> torch.dtype:
    """The serving dtype a checkpoint asks for: bfloat16 when its `config.json` says `"dtype"` (or the older
    `"torch_dtype"`) `"bfloat16"`, else float32 (also for the tiny default and an unreadable config, whose error
    the loader reports)."""
    if model_dir is None:
        return torch.float32
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    named = cfg.get("dtype", cfg.get("torch_dtype")) if isinstance(cfg, dict) else None
    return torch.bfloat16 if named == "bfloat16" else torch.float32


def check_model_dir(path: Path) -> None:
    """Raise `CheckpointError` unless `path` is a directory with a `config.json`, saying what it is instead."""
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; --model takes a checkpoint directory (config.json + weights)")
    if (path / "config.json").exists():
        return
    convert = f"convert it with `flashnext convert --checkpoint {path} --out HF_DIR` and serve HF_DIR"
    if (path / "state.pt").exists() or (path / "meta.json").exists():
        raise CheckpointError(
            f"{path} is a training checkpoint (state.pt, meta.json), not a model directory (config.json + weights): "
            f"{convert}, or serve the run's exported `<out_dir>/final`"
        )
    if (path / "final" / "config.json").exists():
        raise CheckpointError(f"{path} looks like a training run directory: serve its export {path / 'final'}")
    steps = sorted(path.glob("step_*/meta.json"))
    if steps:
        newest = steps[-1].parent
        raise CheckpointError(
            f"{path} holds training checkpoints ({newest.name}, ...), not a model: convert one with "
            f"`flashnext convert --checkpoint {newest} --out HF_DIR` and serve HF_DIR"
        )
    raise CheckpointError(f"{path} has no config.json: not a model directory (config.json + model.safetensors)")


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn of the chat template (`<|im_end|>`), [] if the vocabulary has none."""
    backend = getattr(tokenizer, "backend", None)
    tid = backend.token_to_id(END_OF_TURN) if backend is not None else None
    return [tid] if tid is not None else []


_SHRINKING_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4}  # Unicode forms shrink UTF-8 at most 4x


def max_token_bytes(tokenizer) -> int | None:
    """An upper bound on the UTF-8 bytes of input text one token covers, or None when there is no such bound.

    For a byte-level BPE (pre-tokenizer `ByteLevel`, alone or after non-removing `Split`s) every token is a
    merge of input bytes, so it covers at most as many bytes as its vocabulary string has (each byte-level
    character stands for one byte; added tokens are literal text). A Unicode normalizer can shrink text (a
    4-byte mathematical letter becomes 1 ASCII byte under NFKC), hence the factor 4 with one; other normalizers,
    or pre-tokenizers that drop text (`Whitespace`), give no bound.
    """
    backend = getattr(tokenizer, "backend", None)
    if backend is None or type(backend.model).__name__ != "BPE" or backend.pre_tokenizer is None:
        return None
    pre = json.loads(backend.pre_tokenizer.__getstate__())
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if "ByteLevel" not in kinds or any(
        k not in ("ByteLevel", "Split") or (k == "Split" and p.get("behavior") == "Removed")
        for k, p in zip(kinds, parts, strict=True)
    ):
        return None
    factor = 1
    if backend.normalizer is not None:
        factor = _SHRINKING_NORMALIZERS.get(type(backend.normalizer).__name__)
        if factor is None:
            return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return factor * max(len(t.encode("utf-8")) for t in vocab)
