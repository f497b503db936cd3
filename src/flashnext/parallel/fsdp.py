"""`parallelize`: owner-routed n-gram tables, activation checkpointing, optional compile and FSDP2, from outside.

Order (each step sees the model the previous one left):
  1. swap every PLE n-gram table for an `OwnerRoutedEmbedding` holding this rank's rows (on `meta` the rows stay
     on `meta`; a materialised table is sliced and the full one released);
  2. optional `torch.compile` of each decoder layer (`flashnext.compile.compile_model`, imported only when
     asked for; it must see the plain layers, so it comes before checkpointing);
  3. activation checkpointing per decoder layer (`activation_checkpoint.py`);
  4. FSDP2 `fully_shard` on each decoder layer, then on the root, with the n-gram tables in `ignored_params`: they
     are never all-gathered and their gradients are never reduced (each rank's table gradient already holds every
     rank's contributions to its rows: the embedding's backward all-to-all delivered them);
  5. a model built on `meta` is materialised (`to_empty` on the mesh's device: only shards and local rows are
     allocated) and, with `seed` set, initialised to exactly the unsharded `init_weights(seed)` values
     (`parallel/init.py` says how).

Gradient semantics: FSDP's reduce-scatter *sums* across ranks (`set_gradient_divide_factor(1.0)`), matching the
table gradients and the step-wide loss denominator of `train/loss.py` (each rank divides its loss sum by the
label count of the whole step on all ranks). The global batch's mean gradient therefore comes out whatever the
world size, and a run at world size N equals one at world size 1 given the same global batch.

Without a mesh (a single process with no process group) only steps 2, 3 and 5 apply and the tables stay plain
`nn.Embedding`s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from flashnext.activation_checkpoint import apply_activation_checkpointing
from flashnext.errors import ConfigError
from flashnext.parallel.init import init_weights_local
from flashnext.parallel.owner_embedding import OwnerRoutedEmbedding, swap_ngram_embeddings

__all__ = ["ParallelConfig", "parallelize", "local_row_params", "clip_grad_norm_distributed", "parameter_counts"]


class ParallelConfig(BaseModel):
    """How `parallelize` prepares a model for (distributed) training."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    ac: bool = True
    """Activation checkpointing per decoder layer (recomputed in backward, exact)."""
    compile: bool = False
    """Call `flashnext.compile.compile_model(model)` before FSDP wrapping."""
    dedup: bool = True
    """Owner-routed n-gram lookups send each distinct id once per (rank, owner)."""
    mixed_precision: bool = True
    """On CUDA: bf16 parameters and compute, fp32 gradient reduction (ignored on CPU, which stays fp32)."""
    reshard_after_forward: bool = True
    """FSDP2: free each layer's gathered parameters after its forward (re-gathered in backward)."""
    seed: int | None = 0
    """When the model arrives on `meta`: initialise it as `init_weights(seed)` would; None leaves it uninitialised
    (to be filled from a checkpoint)."""


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _cast_output(dtype: torch.dtype):
    def hook(module, args, out):
        return out.to(dtype)

    return hook


def parallelize(model: nn.Module, mesh: DeviceMesh | None, cfg: ParallelConfig | None = None) -> nn.Module:
    """Prepare a `FlashNextForCausalLM` (on `meta` or materialised) for training on `mesh`; returns the model.

    Args:
        model: built plainly (`FlashNextForCausalLM(cfg)`), on `meta` (cheap: only shards and local rows are ever
            allocated) or materialised with weights (e.g. `from_pretrained` on CPU: every rank must hold the same
            values; they are sliced/sharded in place).
        mesh: the 1-D data-parallel mesh of `init_distributed().mesh`, or None for a single process without a
            process group.
        cfg: `ParallelConfig` (defaults: AC on, compile off, dedup on, bf16 on CUDA, seed 0).

    Returns:
        The same model object (FSDP2 changes its class in place); parameter names are unchanged, so
        `build_optimizer`, `save_state` and `export_pretrained` see the plain model's names.
    """
    cfg = cfg or ParallelConfig()
    if mesh is not None and mesh.ndim != 1:
        raise ConfigError(f"parallelize takes a 1-D data-parallel mesh, got {mesh.ndim}-D {mesh.mesh_dim_names}")
    meta = _on_meta(model)
    device = torch.device(mesh.device_type if mesh is not None else "cpu")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    if mesh is not None:
        swap_ngram_embeddings(model, mesh.get_group(), dedup=cfg.dedup)
        if not meta:  # FSDP moves what it manages to the mesh's device; the ignored tables move here
            for m in model.modules():
                if isinstance(m, OwnerRoutedEmbedding):
                    m.to(device)
    if cfg.compile:  # before checkpointing: compile_model wraps the plain layers (compile.py)
        from flashnext.compile import compile_model

        compile_model(model)
    if cfg.ac:
        apply_activation_checkpointing(model)
    if mesh is not None:
        _shard(model, mesh, cfg, device)
    if meta:
        model.to_empty(device=device)
        if cfg.seed is None:
            model.reset_buffers()
        elif mesh is None:
            model.init_weights(cfg.seed)
        else:
            init_weights_local(model, cfg.seed)
    for p in local_row_params(model):  # after to_empty, which may have replaced the Parameter objects
        p._flashnext_owner_routed = True
    return model


def _shard(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, device: torch.device) -> None:
    """FSDP2 per decoder layer and at the root, n-gram tables ignored, reductions summed."""
    tables = set(local_row_params(model))
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and cfg.mixed_precision:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in model.modules():  # fp32 table rows feed bf16 projections
            if isinstance(m, OwnerRoutedEmbedding):
                m.register_forward_hook(_cast_output(torch.bfloat16))
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward, ignored_params=tables)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def local_row_params(model: nn.Module) -> list[nn.Parameter]:
    """The owner-routed tables' weights: plain tensors holding this rank's rows (gradients are local, exact).

    Frozen stored-dtype tables (`OwnerRoutedEmbedding.from_stored`) hold buffers, not parameters: not listed.
    """
    return [m.weight for m in model.modules() if isinstance(m, OwnerRoutedEmbedding) and not m.frozen]


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(the whole model's parameters, this rank's share of them), the same whole-model count at any world size.

    An FSDP2 shard (DTensor) counts its full shape in the first and its local shard in the second; an owner-routed
    table counts its whole table (`num_embeddings x embedding_dim`) and its local rows; anything else (a plain
    model, replicated parameters) counts the same in both. Frozen stored-dtype tables hold buffers: in neither.
    """
    tables = {id(m.weight): m for m in model.modules() if isinstance(m, OwnerRoutedEmbedding) and not m.frozen}
    total = local = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            total, local = total + p.numel(), local + p.to_local().numel()
        elif id(p) in tables:
            table = tables[id(p)]
            total, local = total + table.num_embeddings * table.embedding_dim, local + p.numel()
        else:
            total, local = total + p.numel(), local + p.numel()
    return total, local


@torch.no_grad()
def clip_grad_norm_distributed(params, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the global gradient norm over every rank's parameters in place; returns the norm before clipping.

    Three kinds of gradient are combined into one norm:
    - DTensor gradients (FSDP2 shards, `Shard` placements): each rank squares its local shard;
    - owner-routed table gradients (plain tensors of local rows, see `local_row_params`): squared locally;
    - any other plain gradient is taken as replicated (the same on every rank) and counted once.
    The first two are summed across `group` with one all-reduce; a world of one (or no process group) sums
    locally. `max_norm <= 0` only measures.

    Args:
        params: parameters (all optimizers' together, e.g. `train.optim.trainable_params(optimizers)`).
        max_norm: the limit of the global L2 norm.
        group: the data-parallel group (default: the world).
    """
    params = [p for p in params if p.grad is not None]
    tables = {id(p) for p in params if isinstance(p, nn.Parameter) and _owner_routed(p)}
    zero = torch.zeros((), dtype=torch.float32)
    sharded, replicated = zero.clone(), zero.clone()
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            if any(pl.is_replicate() for pl in g.placements):
                raise ConfigError(
                    f"clip_grad_norm_distributed: DTensor gradient of shape {tuple(g.shape)} is replicated "
                    f"({g.placements}); only sharded DTensors (FSDP) are supported"
                )
            sharded += g.to_local().float().square().sum().cpu()
        elif id(p) in tables:
            sharded += g.float().square().sum().cpu()
        else:
            replicated += g.float().square().sum().cpu()
    if dist.is_initialized():
        dev = params[0].grad.device if params and _backend_needs_device(group) else torch.device("cpu")
        total_sharded = sharded.to(dev)
        dist.all_reduce(total_sharded, group=group)
        sharded = total_sharded.cpu()
    norm = (sharded + replicated).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.device, g.dtype))
    return norm


def _owner_routed(p: torch.Tensor) -> bool:
    return getattr(p, "_flashnext_owner_routed", False)


def _backend_needs_device(group) -> bool:
    return dist.get_backend(group) == "nccl"
