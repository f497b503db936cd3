"""Export a parallelised model to the official Hugging Face layout, streamed, without gathering an n-gram table.

Files (names fixed by the model's structure, so every rank computes the same plan without communication):
  - one file per decoder layer and one for the rest (embedding, final mixer, lm_head, n-gram hash buffers, extra
    tensors): rank 0 writes them, gathering each FSDP2 parameter with `full_tensor()` one tensor at a time (every
    rank takes part in each gather), so rank 0 holds at most one layer's tensors;
  - one file per n-gram table shard `...ngram_embedding.shard_{j}.weight` (rows cut like
    `torch.chunk(table, split_ngram_parts)`): written by the rank owning the shard's first row, which receives
    the shard's remaining rows from their owners point to point. No rank ever holds more than one shard of a
    table (a whole table only when `split_ngram_parts == 1`, i.e. when the layout itself is one tensor);
  - `model.safetensors.index.json` and `config.json`: rank 0.

`flashnext.from_pretrained` (and transformers) read the result like any sharded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import INDEX_FILE
from flashnext.checkpoint.load import HEAD, ties_embeddings
from flashnext.checkpoint.save import config_dict, model_config_of, write_safetensors
from flashnext.checkpoint.target import begin_staging, check_target, replace_with, staging_dir
from flashnext.config import ModelConfig
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding

__all__ = ["export_pretrained"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _file_groups(model: nn.Module, tables: dict[str, OwnerRoutedEmbedding], parts: int) -> list[tuple[str, list]]:
    """[(kind, members)]: ("params", [param names]) per decoder layer and for the rest, then ("table", [name, j])."""
    per_layer: dict[int, list[str]] = {}
    rest: list[str] = []
    for name, _ in model.named_parameters():
        if name in tables:
            continue
        if name.startswith("model.layers."):
            per_layer.setdefault(int(name.split(".")[2]), []).append(name)
        else:
            rest.append(name)
    groups = [("params", per_layer[i]) for i in sorted(per_layer)] + [("rest", rest)]
    for name, table in tables.items():
        for j, _ in enumerate(layout.ngram_shard_rows(table.num_embeddings, parts)):
            groups.append(("table", [name, j]))
    return groups


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _wire(rows: torch.Tensor) -> torch.Tensor:
    """FP8 rows (a frozen table) travel as their bytes: gloo has no float8 types."""
    return rows.view(torch.uint8) if rows.is_floating_point() and rows.element_size() == 1 else rows


def _table_shard(table: OwnerRoutedEmbedding, a: int, b: int) -> torch.Tensor | None:
    """Rows [a, b) of `table` on the rank owning row a (None elsewhere), sent there by the other owners."""
    writer = next(r for r, (s, e) in enumerate(table.ranges) if s <= a < e)
    me = table.rank
    if me != writer:
        s, e = max(a, table.row_start), min(b, table.row_end)
        if s < e:
            rows = table.weight.detach()[s - table.row_start : e - table.row_start].contiguous()
            dist.send(
                _wire(rows), dist.get_global_rank(table.group, writer) if table.group else writer, group=table.group
            )
        return None
    out = torch.empty(b - a, table.embedding_dim, dtype=table.weight.dtype, device=table.weight.device)
    for r, (s, e) in enumerate(table.ranges):
        s, e = max(a, s), min(b, e)
        if s >= e:
            continue
        if r == me:
            out[s - a : e - a].copy_(table.weight.detach()[s - table.row_start : e - table.row_start])
        else:
            src = dist.get_global_rank(table.group, r) if table.group else r
            dist.recv(_wire(out[s - a : e - a]), src, group=table.group)
    return out


@torch.no_grad()
def export_pretrained(
    model: nn.Module, directory: str | Path, *, config: ModelConfig | None = None, overwrite: bool = False
) -> list[Path]:
    """Write `model` (after `parallelize`, or plain) to `directory` in the official layout; collective.

    Every rank must call it. Parameters are written in their current dtype. The files go to a staging directory
    beside `directory` which then replaces it whole (`checkpoint.target`).

    Args:
        model: a `FlashNextForCausalLM`, possibly FSDP2-sharded with owner-routed n-gram tables.
        directory: output directory (must be visible to every writing rank): absent or empty unless `overwrite`.
        config: the checkpoint config (default: `model.model_config`, else the model's `TextConfig`).
        overwrite: replace a non-empty `directory` whole.

    Returns:
        The files this rank wrote (rank 0: layer/rest files, index, config; table owners: their shards).

    Raises:
        CheckpointError: on every rank, when `directory` is not empty and `overwrite` is False.
    """
    cfg = config or model_config_of(model)
    style = layout.COMPOSITE if cfg.composite else layout.TEXT
    parts = cfg.text.split_ngram_parts
    final = Path(directory)
    main = _rank() == 0
    check_target(final, overwrite)  # every rank: all refuse, or none
    if dist.is_initialized():
        dist.barrier()  # every rank looked before rank 0 stages anything
    directory = begin_staging(final) if main else staging_dir(final)
    if dist.is_initialized():
        dist.barrier()
    tables = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, OwnerRoutedEmbedding)}
    params = dict(model.named_parameters())
    skip_head = ties_embeddings(cfg)
    groups = _file_groups(model, tables, parts)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    written: list[Path] = []
    dtype, total = torch.float32, 0
    for fname, (kind, members) in zip(names, groups, strict=True):
        out: dict[str, torch.Tensor] = {}
        if kind == "table":
            name, j = members
            table = tables[name]
            a, b = layout.ngram_shard_rows(table.num_embeddings, parts)[j]
            disk_key = layout.to_disk_name(name.removesuffix(".weight"), style) + f".shard_{j}.weight"
            weight_map[disk_key] = fname
            total += (b - a) * table.embedding_dim * table.weight.element_size()
            shard = _table_shard(table, a, b)
            if shard is not None:
                out[disk_key] = shard.cpu()
        else:
            for name in members:
                if skip_head and name == HEAD:
                    continue
                full = _full(params[name])  # collective for DTensors: every rank gathers, rank 0 keeps
                dtype = full.dtype if full.is_floating_point() else dtype
                total += full.numel() * full.element_size()
                for slot in layout.slots_for(name, tuple(full.shape), style=style, split_ngram_parts=parts):
                    weight_map[slot.disk_key] = fname
                    if main:
                        out[slot.disk_key] = full[slot.index].contiguous().cpu()
                del full
            if kind == "rest":
                extras = [
                    (layout.to_disk_name(k, style), b) for k, b in model.named_buffers() if layout.is_derived_buffer(k)
                ]
                extras += [(k, t) for k, t in getattr(model, "extra_tensors", {}).items()]
                extras += [  # the scale of a frozen FP8 table (every rank holds it whole)
                    (layout.to_disk_name(name.removesuffix(".weight") + ".weight_scale", style), t.weight_scale)
                    for name, t in tables.items()
                    if t.frozen and t.weight_scale is not None
                ]
                for key, t in extras:
                    weight_map[key] = fname
                    total += t.numel() * t.element_size()
                    if main:
                        out[key] = t.detach().contiguous().cpu()
        if out:
            write_safetensors(out, directory / fname)
            written.append(directory / fname)
    if main:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (directory / "config.json").write_text(json.dumps(config_dict(cfg, dtype), indent=2, sort_keys=True) + "\n")
        written += [directory / INDEX_FILE, directory / "config.json"]
    if dist.is_initialized():
        dist.barrier()
    if main:
        replace_with(directory, final)
    if dist.is_initialized():
        dist.barrier()
    return [final / f.name for f in written]
