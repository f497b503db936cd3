"""A randomly initialised checkpoint whose n-gram tables are generated straight into the files, shard by shard.

For tests and benchmarks of tables larger than memory should hold twice: the model is built with empty tables
(so `init_weights` materialises only the rest), and each table shard is drawn in `CHUNK_BYTES` pieces while it
is written (`stream_write`). The layout is the official one: one file for everything else, one per table shard,
an index and `config.json`; `from_pretrained` loads it in any n-gram storage mode.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import CHUNK_BYTES, INDEX_FILE, TORCH_DTYPES
from flashnext.checkpoint.fp8 import fp8_scale, quantize_fp8
from flashnext.checkpoint.ngram_tables import ngram_tables
from flashnext.checkpoint.save import config_dict, tensor_entries
from flashnext.checkpoint.stream_write import ITEM_BYTES, Entry, write_safetensors
from flashnext.config import ModelConfig, TextConfig


def _table_chunks(rows: int, width: int, seed: int, std: float, dtype: str, scale: float | None):
    gen = torch.Generator().manual_seed(seed)
    step = max(1, CHUNK_BYTES // (width * 4))
    for a in range(0, rows, step):
        values = torch.randn(min(step, rows - a), width, generator=gen).mul_(std)
        yield quantize_fp8(values, scale) if scale is not None else values.to(TORCH_DTYPES[dtype])


@torch.no_grad()
def write_synthetic_checkpoint(
    cfg: TextConfig, directory: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    table_dtype: str = "BF16",
) -> int:  # fmt: skip
    """Write a random `cfg` model to `directory`; returns the n-gram tables' bytes on disk.

    Args:
        cfg: the text config.
        directory: created if needed.
        seed: every tensor's values follow from it (`init_weights(seed)`; each shard has its own generator).
        dtype: dtype of every tensor but the tables.
        table_dtype: `BF16`, `F32` or `F8_E4M3` (FP8 rows with the scale of normal(0, std) values at 5 std).
    """
    from flashnext.model.text import FlashNextForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg)
    shapes = {}
    for key, ngram in ngram_tables(model):
        shapes[key] = tuple(ngram.ngram_embedding.weight.shape)
        ngram.ngram_embedding = nn.Embedding(0, shapes[key][1], device="meta")  # no rows: written below
    model.to(dtype).to_empty(device="cpu")
    model.init_weights(seed)
    std = cfg.initializer_range
    mcfg = ModelConfig(text=cfg)
    rest = [
        Entry(k, _st_dtype(t), tuple(t.shape), lambda t=t: [t]) for k, t in tensor_entries(model, layout.TEXT, mcfg)
    ]
    files = {"model-rest.safetensors": rest}
    scale = fp8_scale(5 * std) if table_dtype == "F8_E4M3" else None
    nbytes = 0
    for t, (key, (rows, width)) in enumerate(shapes.items()):
        slots = layout.slots_for(key, (rows, width), style=layout.TEXT, split_ngram_parts=cfg.split_ngram_parts)
        for j, slot in enumerate(slots):
            n = slot.shape[0]
            seed_j = seed * 7919 + t * 1009 + j
            chunks = lambda n=n, w=width, s=seed_j: _table_chunks(n, w, s, std, table_dtype, scale)
            files[f"model-table{t}-{j:05d}.safetensors"] = [Entry(slot.disk_key, table_dtype, slot.shape, chunks)]
            nbytes += math.prod(slot.shape) * ITEM_BYTES[table_dtype]
        if scale is not None:
            pre = layout.to_disk_name(key.removesuffix(".weight"), layout.TEXT)
            value = torch.tensor(scale, dtype=torch.float32)
            rest.append(Entry(f"{pre}.weight_scale", "F32", (), lambda v=value: [v]))
    weight_map, total = {}, 0
    for name, entries in files.items():
        total += write_safetensors(directory / name, entries, durable=False)
        weight_map.update({e.key: name for e in entries})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config_dict(mcfg, dtype), indent=2, sort_keys=True) + "\n")
    return nbytes


def _st_dtype(t: torch.Tensor) -> str:
    return next(name for name, d in TORCH_DTYPES.items() if d == t.dtype)
