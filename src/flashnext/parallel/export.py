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


class _Index:
    """The index being built while `export_pretrained` writes its files: each disk key's file, the total bytes and
    the float dtype of the parameters (for `config.json`); the methods return the tensors of one file that this
    rank writes."""

    def __init__(self, cfg: ModelConfig, main: bool):
        self.cfg, self.main = cfg, main
        self.style = layout.COMPOSITE if cfg.composite else layout.TEXT
        self.parts = cfg.text.split_ngram_parts
        self.weight_map: dict[str, str] = {}
        self.dtype, self.total = torch.float32, 0

    def table_shard(self, fname: str, table: OwnerRoutedEmbedding, name: str, j: int) -> dict[str, torch.Tensor]:
        """Shard j of an owner-routed table: written by the rank that owns its rows."""
        a, b = layout.ngram_shard_rows(table.num_embeddings, self.parts)[j]
        disk_key = layout.to_disk_name(name.removesuffix(".weight"), self.style) + f".shard_{j}.weight"
        self.weight_map[disk_key] = fname
        self.total += (b - a) * table.embedding_dim * table.weight.element_size()
        shard = _table_shard(table, a, b)
        return {} if shard is None else {disk_key: shard.cpu()}

    def params(self, fname: str, params: dict[str, torch.Tensor], members: list[str]) -> dict[str, torch.Tensor]:
        """The parameters `members` under their disk keys (gathered on every rank, kept by rank 0)."""
        skip_head, out = ties_embeddings(self.cfg), {}
        for name in members:
            if skip_head and name == HEAD:
                continue
            full = _full(params[name])  # collective for DTensors: every rank gathers, rank 0 keeps
            self.dtype = full.dtype if full.is_floating_point() else self.dtype
            self.total += full.numel() * full.element_size()
            slots = layout.slots_for(name, tuple(full.shape), style=self.style, split_ngram_parts=self.parts)
            for slot in slots:
                self.weight_map[slot.disk_key] = fname
                if self.main:
                    out[slot.disk_key] = full[slot.index].contiguous().cpu()
            del full
        return out

    def extras(self, fname: str, model: nn.Module, tables: dict[str, OwnerRoutedEmbedding]) -> dict[str, torch.Tensor]:
        """What the last file holds besides parameters: derived buffers, the model's extra tensors and the scale of
        a frozen FP8 table (every rank holds it whole)."""
        buffers = [(k, b) for k, b in model.named_buffers() if layout.is_derived_buffer(k)]
        extras = [(layout.to_disk_name(k, self.style), b) for k, b in buffers]
        extras += list(getattr(model, "extra_tensors", {}).items())
        extras += [
            (layout.to_disk_name(name.removesuffix(".weight") + ".weight_scale", self.style), t.weight_scale)
            for name, t in tables.items()
            if t.frozen and t.weight_scale is not None
        ]
        out = {}
        for key, t in extras:
            self.weight_map[key] = fname
            self.total += t.numel() * t.element_size()
            if self.main:
                out[key] = t.detach().contiguous().cpu()
        return out

    def write(self, directory: Path) -> list[Path]:
        """The index file and `config.json` (rank 0)."""
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = json.dumps(config_dict(self.cfg, self.dtype), indent=2, sort_keys=True)
        (directory / "config.json").write_text(config + "\n")
        return [directory / INDEX_FILE, directory / "config.json"]


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
    final = Path(directory)
    main = _rank() == 0
    check_target(final, overwrite)  # every rank: all refuse, or none
    if dist.is_initialized():
        dist.barrier()  # every rank looked before rank 0 stages anything
    directory = begin_staging(final) if main else staging_dir(final)
    if dist.is_initialized():
        dist.barrier()
    index = _Index(cfg, main)
    tables = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, OwnerRoutedEmbedding)}
    params = dict(model.named_parameters())
    groups = _file_groups(model, tables, index.parts)
    written: list[Path] = []
    for i, (kind, members) in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        if kind == "table":
            out = index.table_shard(fname, tables[members[0]], members[0], members[1])
        else:
            out = index.params(fname, params, members)
            if kind == "rest":
                out |= index.extras(fname, model, tables)
        if out:
            write_safetensors(out, directory / fname)
            written.append(directory / fname)
    if main:
        written += index.write(directory)
    if dist.is_initialized():
        dist.barrier()
    if main:
        replace_with(directory, final)
    if dist.is_initialized():
        dist.barrier()
    return [final / f.name for f in written]
