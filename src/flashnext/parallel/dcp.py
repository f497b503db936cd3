"""Sharded training checkpoints with `torch.distributed.checkpoint` (DCP): model, optimizers, and `extra` state.

Layout of a checkpoint directory:
  `.metadata`, `__*_*.distcp`   DCP's files: every tensor of the model and optimizer states under the keys
                                `model.<param>` and `optim.<optimizer>.<param>.<state>` (e.g.
                                `optim.adamw.lm_head.weight.exp_avg`);
  `trainer_state.pt`            written by rank 0 with `torch.save`: the optimizers' param-group settings (lr,
                                betas, ...), which state entries each parameter has, the world size it was saved
                                at, and the caller's `extra` dict (scheduler, data position, RNG: plain picklable
                                state; rank 0's copy is kept, so it must be the same on every rank).

How each tensor is stored, so a checkpoint restores onto any world size (and a single process):
  - FSDP2 parameters and their optimizer states are DTensors: DCP records each shard's global offset and
    re-slices on load;
  - an owner-routed n-gram table (and every optimizer state shaped like it) holds rows `[row_start, row_end)` on
    its rank: it is wrapped as a `ShardedTensor` whose one local shard has global offset `(row_start, 0)` (ranks
    with no rows contribute no shard), so DCP sees the whole `[rows, dim]` table and any other split (or a plain
    full table in a single process) reads exactly its rows back;
  - scalars (AdamW's `step`) and any other plain tensor are replicated (DCP keeps one copy).

Saving is atomic: everything is written into `<dir>.tmp`, then rank 0 renames it to `<dir>` (an older `<dir>` is
moved aside first and removed after), so `<dir>` is either the previous complete checkpoint or the new one.
Restoring is exact: every value that affects the next step (parameters, moments, step counts, learning rates)
comes back bit for bit, so one further step equals the uninterrupted run's (tested).

Works without a process group too (a single process: DCP runs with `no_dist`).
"""

from __future__ import annotations

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, init_from_local_shards

from flashnext.checkpoint.training import SHARDED_STATE_FILE, shape_mismatch
from flashnext.errors import CheckpointError
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding

__all__ = ["save_state", "load_state"]

STATE_FILE = SHARDED_STATE_FILE
_FORMAT = 1


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextmanager
def _quiet_dcp():
    # DCP's planner reads ShardedTensor attributes, which warn "deprecating ShardedTensor" on every access; the
    # table wrapper is deliberate (DTensor cannot express the owner-routed row split, see the module docstring).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        # Single process: DCP warns that it assumes no process group, which is what we asked for (no_dist).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled.*", category=UserWarning)
        yield


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _tables(model: nn.Module) -> dict[int, OwnerRoutedEmbedding]:
    """id(table weight) -> its owner-routed module."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, OwnerRoutedEmbedding)}


def _rows_as_sharded(local: torch.Tensor, table: OwnerRoutedEmbedding) -> ShardedTensor:
    """This rank's rows `[local_rows, dim]` as one shard of the global `[rows, dim]` table (no copy)."""
    rows, dim = table.num_embeddings, table.embedding_dim
    group_rank = dist.get_rank(table.group)
    shards = []
    if local.shape[0] > 0:
        meta = ShardMetadata([table.row_start, 0], [local.shape[0], dim], f"rank:{group_rank}/{local.device}")
        shards.append(Shard(local, meta))
    return init_from_local_shards(shards, rows, dim, process_group=table.group)


def _wrap(t: torch.Tensor, p: torch.Tensor, tables: dict[int, OwnerRoutedEmbedding]) -> torch.Tensor:
    """How tensor `t` (the parameter `p` itself, or one of its optimizer states) is handed to DCP."""
    table = tables.get(id(p))
    if table is not None and t.shape == p.shape:
        return _rows_as_sharded(t.detach(), table)
    return t.detach()  # DTensor or plain: shares storage, so a load lands in place


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    tables = _tables(model)
    state = {}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = _wrap(p, p, tables)
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers():
        if name in persistent:  # persistent buffers only: a frozen owner-routed table's rows and scale
            state[f"model.{name}"] = _wrap(b, b, tables)
    return state


def _optim_state(model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> tuple[dict, dict]:
    """DCP entries of every optimizer state tensor, and the plain part (param groups, state layout)."""
    names, tables = _names(model), _tables(model)
    tensors, plain = {}, {}
    for opt_name, opt in optimizers.items():
        layout, groups = {}, []
        for group in opt.param_groups:
            groups.append(
                {k: v for k, v in group.items() if k != "params"} | {"params": [names[id(p)] for p in group["params"]]}
            )
            for p in group["params"]:
                st = opt.state.get(p, {})
                layout[names[id(p)]] = {}
                for key, value in st.items():
                    if not isinstance(value, torch.Tensor):
                        layout[names[id(p)]][key] = ("object", value)
                        continue
                    kind = "param" if value.shape == p.shape else "tensor"
                    layout[names[id(p)]][key] = (kind, tuple(value.shape), value.dtype)
                    tensors[f"optim.{opt_name}.{names[id(p)]}.{key}"] = _wrap(value, p, tables)
        plain[opt_name] = {"param_groups": groups, "state": layout}
    return tensors, plain


def save_state(
    directory: str | Path, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer], extra: dict | None = None
) -> Path:
    """Write a sharded checkpoint of `model` (after `parallelize`), its optimizers and `extra`; collective.

    Every rank must call it. Atomic (see the module docstring). An existing `directory` is replaced.

    Args:
        directory: the checkpoint directory (a shared filesystem path when ranks span machines).
        model: the parallelised (or plain, in a single process) model.
        optimizers: `{name: optimizer}` as `train.optim.build_optimizer` returns (any dict of optimizers works;
            names must match at load).
        extra: plain picklable trainer state (scheduler state dicts, data position, RNG states...); rank 0's copy
            is stored.

    Returns:
        The checkpoint directory.
    """
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with _quiet_dcp():
        model_tensors = _model_state(model)
        optim_tensors, optim_plain = _optim_state(model, optimizers)
        dcp.save({**model_tensors, **optim_tensors}, checkpoint_id=tmp, no_dist=not _distributed())
    if _is_main():
        world = dist.get_world_size() if _distributed() else 1
        state = {"format": _FORMAT, "world_size": world, "optimizers": optim_plain, "extra": extra or {}}
        torch.save(state, tmp / STATE_FILE)
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _placeholder(spec: tuple, p: torch.Tensor) -> torch.Tensor:
    kind, shape, dtype = spec
    if kind == "param":
        return torch.zeros_like(p, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)  # replicated plain tensor (e.g. AdamW's scalar `step`)


def load_state(directory: str | Path, model: nn.Module, optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """Restore a `save_state` checkpoint into `model` and `optimizers` in place, at any world size; collective.

    `model` must have been built and parallelised the same way as for `save_state` (same parameter names; the
    world size may differ), and `optimizers` built over it with the same names and groups (their state may be
    empty: it is created).

    Returns:
        The `extra` dict given to `save_state`.

    Raises:
        CheckpointError: the directory has no complete checkpoint, or an optimizer/parameter does not match it.
    """
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file() or not (directory / ".metadata").is_file():
        raise CheckpointError(f"{directory} holds no complete checkpoint (missing {STATE_FILE} or .metadata)")
    saved = torch.load(directory / STATE_FILE, weights_only=False)
    with _quiet_dcp():
        dest, states = _load_destinations(directory, saved, model, optimizers)
        _check_shapes(directory, dest)
        with torch.no_grad():
            dcp.load(dest, checkpoint_id=directory, no_dist=not _distributed())
    names = _names(model)
    for opt_name, opt in optimizers.items():
        saved_groups = saved["optimizers"][opt_name]["param_groups"]
        if len(saved_groups) != len(opt.param_groups):
            raise CheckpointError(
                f"optimizer {opt_name!r}: {len(opt.param_groups)} param groups, saved {len(saved_groups)}"
            )
        for group, g_saved in zip(opt.param_groups, saved_groups, strict=True):
            if g_saved["params"] != [names[id(p)] for p in group["params"]]:
                raise CheckpointError(f"optimizer {opt_name!r}: parameters of a param group differ from {directory}")
            group.update({k: v for k, v in g_saved.items() if k != "params"})
        opt.state.clear()
        for p, st in states[opt_name].items():
            if st:
                opt.state[p] = st
    return saved["extra"]


def _check_shapes(directory: Path, dest: dict) -> None:
    """A model (or optimizer state) of another shape than the checkpoint's is refused naming the tensor and both
    (global) shapes, before DCP reads anything."""
    stored = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    saved = {k: tuple(m.size) for k, m in stored.items() if k in dest and hasattr(m, "size")}
    ours = {k: tuple(t.size()) for k, t in dest.items() if k in saved}
    shape_mismatch(directory, ours, saved)


def _load_destinations(directory: Path, saved: dict, model: nn.Module, optimizers: dict) -> tuple[dict, dict]:
    """The tensors DCP loads into (the parameters themselves, new optimizer state tensors) and the new states."""
    names, tables = _names(model), _tables(model)
    dest = _model_state(model)
    states: dict[str, dict[torch.Tensor, dict]] = {}
    for opt_name, opt in optimizers.items():
        if opt_name not in saved["optimizers"]:
            raise CheckpointError(f"optimizer {opt_name!r} is not in {directory} (it has {list(saved['optimizers'])})")
        layout = saved["optimizers"][opt_name]["state"]
        states[opt_name] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                if name not in layout:
                    raise CheckpointError(f"parameter {name!r} of optimizer {opt_name!r} is not in {directory}")
                st = {}
                for key, spec in layout[name].items():
                    if spec[0] == "object":
                        st[key] = spec[1]
                        continue
                    st[key] = _placeholder(spec, p)
                    dest[f"optim.{opt_name}.{name}.{key}"] = _wrap(st[key], p, tables)
                states[opt_name][p] = st
    return dest, states
