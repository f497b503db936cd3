"""Whole-matrix optimizers (Muon, per-expert Muon) on FSDP2-sharded parameters.

AdamW is elementwise, so it runs on FSDP2's DTensor shards as they are. Muon orthogonalises each *whole* matrix
(Newton–Schulz on `[m, n]`): torch's Muon fails on a `Shard(0)` DTensor (its in-place update would need a placement
change), and `ExpertMuon`'s per-expert `unbind(0)` of a `Shard(0)` `[E, m, n]` would even act on a redistributed
copy. `gather_step` makes such an optimizer step one parameter at a time on full tensors:

  for each parameter with a gradient: all-gather the parameter, its gradient and its DTensor states
  (`full_tensor()`); on the parameter's *owner* rank only (parameters are dealt round-robin over the mesh), run
  the optimizer's own `step()` on those full tensors with every other parameter hidden; then scatter the new
  parameter and states from the owner (`distribute_tensor(..., src_data_rank=owner)`): every rank keeps its shard.

So the update is the single-process update on the gathered full matrix (exactly: same function, same inputs),
memory is one parameter's full tensors at a time, and each matrix's Newton–Schulz runs once in the mesh instead
of on every rank. The momentum buffer is created (zeros, as Muon does lazily) before a parameter's first step,
so every rank holds the same state keys to scatter into. States stay DTensor shards between steps, so
`save_state` / `load_state` treat them like AdamW's.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from flashnext.muon import Muon

__all__ = ["gather_step", "shard_aware_optimizers"]

WHOLE_MATRIX = (torch.optim.Muon, Muon)  # Muon covers ExpertMuon (a subclass)


def _shard_like(full: torch.Tensor, like: DTensor, src: int | None = None) -> DTensor:
    """`full` as a DTensor placed like `like`: each rank's own shard (`src=None`), or scattered from mesh rank
    `src` (the other ranks' `full` is only a placeholder of the right shape)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=src)


@torch.no_grad()
def _step_one(opt: torch.optim.Optimizer, step_fn, group_index: int, p: DTensor, owner: int) -> None:
    """`step_fn()` on mesh rank `owner` with `p` replaced by full tensors in group `group_index` and all other
    parameters hidden; the new parameter and states are scattered from there."""
    full = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
    full.grad = p.grad.full_tensor()
    state = opt.state.pop(p, {})
    state.setdefault("momentum_buffer", _shard_like(torch.zeros(p.shape, dtype=p.dtype, device=full.device), p))
    new_state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    if p.device_mesh.get_local_rank() == owner:
        opt.state[full] = new_state
        saved = [g["params"] for g in opt.param_groups]
        try:
            for i, g in enumerate(opt.param_groups):
                g["params"] = [full] if i == group_index else []
            step_fn()
        finally:
            for g, params in zip(opt.param_groups, saved, strict=True):
                g["params"] = params
            new_state = opt.state.pop(full, {})
    p.to_local().copy_(_shard_like(full.detach(), p, owner).to_local())
    opt.state[p] = {
        k: _shard_like(v, p, owner) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
        for k, v in new_state.items()
    }


def gather_step(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `opt.step()` run on gathered full tensors for its DTensor parameters (see the module docstring).

    Plain (non-DTensor) parameters are stepped together as before, in one call of the original `step`. Returns
    `opt` (patched on the instance; `state_dict`, param groups and schedulers are unaffected).
    """
    if getattr(opt, "_flashnext_gather_step", False):
        return opt
    original = opt.step

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plain, n = [], 0
        for i, g in enumerate(self.param_groups):
            plain.append([p for p in g["params"] if not isinstance(p, DTensor)])
            for p in g["params"]:
                if isinstance(p, DTensor) and p.grad is not None:  # the same order on every rank
                    _step_one(self, original, i, p, owner=n % p.device_mesh.size())
                    n += 1
        if any(plain):
            saved = [g["params"] for g in self.param_groups]
            try:
                for g, params in zip(self.param_groups, plain, strict=True):
                    g["params"] = params
                original()
            finally:
                for g, params in zip(self.param_groups, saved, strict=True):
                    g["params"] = params
        return loss

    opt.step = types.MethodType(step, opt)
    opt._flashnext_gather_step = True
    return opt


def shard_aware_optimizers(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, torch.optim.Optimizer]:
    """`gather_step` on every whole-matrix optimizer (Muon, ExpertMuon) of `build_optimizer`'s dict; returns it.

    Call it once after `build_optimizer(model, ...)` on a model from `parallelize` (a no-op for plain tensors).
    """
    for opt in optimizers.values():
        if isinstance(opt, WHOLE_MATRIX):
            gather_step(opt)
    return optimizers
