"""Write a model in the official checkpoint layout, loadable by transformers' `from_pretrained`.

Per-expert keys, `split_ngram_parts` n-gram shards cut exactly like `torch.chunk`, the three n-gram hash
buffers, `model.extra_tensors` (mtp/visual) written back under their own names, `config.json`, and
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` when the weights exceed one shard.
Each output file's dict holds views into the parameters (a contiguous slice such as `gate_up_proj[e, :I]` is
written without a copy), so saving costs at most one file's worth of memory for non-CPU or non-contiguous
tensors and nothing extra otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import INDEX_FILE, SINGLE_FILE
from flashnext.checkpoint.load import HEAD, shares_embedding, ties_embeddings
from flashnext.checkpoint.target import writing
from flashnext.config import ModelConfig, TextConfig
from flashnext.errors import CheckpointError

DEFAULT_MAX_SHARD_BYTES = 50 * 10**9  # transformers' default "50GB"


def model_config_of(model: torch.nn.Module) -> ModelConfig:
    """The `ModelConfig` a model was built from: `model.model_config`, else its `config`/`cfg` TextConfig."""
    cfg = getattr(model, "model_config", None)
    if isinstance(cfg, ModelConfig):
        return cfg
    for name in ("config", "cfg"):
        text = getattr(model, name, None)
        if isinstance(text, TextConfig):
            return ModelConfig(text=text)
    raise CheckpointError(
        f"{type(model).__name__} has no model_config (ModelConfig) or config/cfg (TextConfig); pass config="
    )


def _skip_head(ours: dict[str, torch.Tensor], tie: bool) -> bool:
    """Tied checkpoints carry no `lm_head.weight` (as transformers writes them)."""
    if shares_embedding(ours):
        return True
    if not tie or HEAD not in ours:
        return False
    embed = layout.embed_name(ours)
    if torch.equal(ours[HEAD], ours[embed]):
        return True
    raise CheckpointError(
        f"tie_word_embeddings=True but {HEAD} differs from {embed}: a tied checkpoint cannot hold both"
    )


def tensor_entries(model: torch.nn.Module, style: str, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """(disk key, tensor view) for every tensor of `model` to write (tables that stay in their files,
    `ngram_storage="mmap"`, are not among them: `table_entries`)."""
    buffers = {k: b for k, b in model.named_buffers() if layout.is_derived_buffer(k)}
    return state_entries(model.state_dict(), buffers, getattr(model, "extra_tensors", {}), style, cfg)


def table_entries(model: torch.nn.Module, style: str, parts: int, directory: Path) -> list[tuple[str, torch.Tensor]]:
    """(disk key, tensor) pairs that n-gram tables write besides `state_dict` (an `NgramTable`'s `saved_entries`:
    the rows of a table read from the files; an NF4 table refuses). Found by name: this package imports no table
    class."""
    out = []
    for name, module in model.named_modules():
        if hasattr(module, "saved_entries"):
            out += module.saved_entries(name, style, parts, directory)
    return out


def state_entries(
    state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    extra: dict[str, torch.Tensor],
    style: str,
    cfg: ModelConfig,
) -> list[tuple[str, torch.Tensor]]:
    """(disk key, tensor view) for a state dict in our names, in its order, then the derived n-gram buffers
    (`buffers`, our names), then `extra` tensors (already disk names) not written yet."""
    skip_head = _skip_head(state, ties_embeddings(cfg))
    out: list[tuple[str, torch.Tensor]] = []
    for key, tensor in state.items():
        if layout.is_derived_buffer(key) or (skip_head and key == HEAD):
            continue
        for slot in layout.slots_for(key, tensor.shape, style=style, split_ngram_parts=cfg.text.split_ngram_parts):
            out.append((slot.disk_key, tensor[slot.index]))
    for key, buf in buffers.items():
        out.append((layout.to_disk_name(key, style), buf))
    written = {k for k, _ in out}
    out.extend((key, tensor) for key, tensor in extra.items() if key not in written)
    return out


def _shard(entries: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy split in order; a tensor larger than `max_bytes` gets a file of its own (as transformers does)."""
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in entries:
        n = tensor.numel() * tensor.element_size()
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append((key, tensor))
        size += n
    return files


def config_dict(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The `config.json` of a checkpoint whose floating-point tensors are `dtype` (as transformers writes it)."""
    out = cfg.to_dict()
    out["dtype"] = str(dtype).removeprefix("torch.")  # transformers' dtype="auto" reads this
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`safetensors.torch.save_file` with the permissions `open()` gives a new file (0666 less the umask):
    safetensors creates its file 0600, which would make the weights the one file of a checkpoint other users
    (or a serving account) cannot read."""
    save_file(tensors, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    # Linux reports it in /proc without changing it; os.umask can only read by setting (briefly, for every thread).
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


@torch.no_grad()
def save_pretrained(
    model: torch.nn.Module,
    directory: str | Path,
    *,
    config: ModelConfig | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write `model` to `directory` in the official layout (text or composite, as its config says).

    Args:
        model: a model whose state_dict follows the reference's in-memory names; its derived n-gram buffers are
            taken from `model.named_buffers()` and `model.extra_tensors` (if any) are written back as they are.
        directory: output directory: absent or empty, else refused unless `overwrite` (`checkpoint.target`).
        config: the checkpoint config; default `model_config_of(model)`. A composite config writes the decoder
            under `model.language_model.*`.
        max_shard_bytes: largest file size before splitting into `model-0000i-of-0000n.safetensors` + index.
        overwrite: replace a non-empty `directory` whole (written beside it, then swapped in: no old file stays).

    Returns:
        The directory.

    Raises:
        CheckpointError: `directory` is not empty and `overwrite` is False, or the model holds weight-only int8 /
            int4 modules (`flashnext.quant`: their packed kernel layouts are no checkpoint); nothing is written.
    """
    _refuse_int_modules(model)
    cfg = config or model_config_of(model)
    style = layout.model_style(model.state_dict()) or (layout.COMPOSITE if cfg.composite else layout.TEXT)
    directory = Path(directory)
    entries = tensor_entries(model, style, cfg) + table_entries(model, style, cfg.text.split_ngram_parts, directory)
    with writing(directory, overwrite) as tmp:
        write_checkpoint(tmp, entries, cfg, max_shard_bytes)
    return directory


def _refuse_int_modules(model: torch.nn.Module) -> None:
    # by module path: `checkpoint/` sits below `quant/` and does not import it
    quantized = [n for n, m in model.named_modules() if type(m).__module__.startswith("flashnext.quant.")]
    if quantized:
        raise CheckpointError(
            f"save_pretrained: the model holds weight-only int8/int4 modules ({quantized[0]}, {len(quantized)} in "
            "all), whose packed CPU layouts are not a checkpoint; save the float model, then `flashnext quantize "
            "--weights int8|int4` it (or keep the int checkpoint it was loaded from)"
        )


def write_checkpoint(
    directory: Path, entries: list[tuple[str, torch.Tensor]], cfg: ModelConfig, max_shard_bytes: int
) -> Path:
    """Write (disk key, tensor) entries as `model.safetensors` or shards + index, and `config.json`, into a new
    (empty) `directory` (`checkpoint.target.writing` gives one)."""
    files = _shard(entries, max_shard_bytes)
    directory.mkdir(parents=True, exist_ok=True)
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    for name, group in zip(names, files, strict=True):
        tensors = {k: t if t.is_contiguous() else t.contiguous() for k, t in group}
        write_safetensors(tensors, directory / name)
        del tensors
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for _, t in entries)
        weight_map = {k: name for name, group in zip(names, files, strict=True) for k, _ in group}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    dtype = next((t.dtype for _, t in entries if t.is_floating_point()), torch.float32)
    (directory / "config.json").write_text(json.dumps(config_dict(cfg, dtype), indent=2, sort_keys=True) + "\n")
    return directory
