"""Shared training scenario of the parallel tests: the tiny model, 3 AdamW steps of 2 micro-batches, AC on.

The global batch of each micro-batch is `SEQS` sequences; rank r of W trains on sequences `r::W`, and every loss is
divided by the label count of the whole step (all micro-batches, all ranks), so the global gradient is the same at
every world size. `reference_run` is the unsharded single-process run the parallel runs must equal.

`run_rank(rank, world, root, restore_from)` is the per-rank body spawned by the tests (one group per world size,
every check in it): init parity, 2 steps, `save_state`, 1 step (the uninterrupted run), a fresh model restored
from the checkpoint continuing 1 step, `export_pretrained`, and optionally a restore from another world size's
checkpoint.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flashnext.config import TextConfig, parse_config
from flashnext.model.text import FlashNextForCausalLM
from flashnext.parallel import (
    OwnerRoutedEmbedding,
    ParallelConfig,
    clip_grad_norm_distributed,
    export_pretrained,
    init_distributed,
    load_state,
    parallelize,
    parameter_counts,
    save_state,
)
from flashnext.parallel.optim import shard_aware_optimizers
from flashnext.train.loss import count_label_tokens, sft_loss
from flashnext.train.optim import OptimConfig, build_optimizer

STEPS, MICRO, SEQS, SAVE_AFTER = 3, 2, 4, 2
LR, MAX_NORM, SEED = 1e-3, 0.5, 0


@functools.cache
def small_model_config() -> TextConfig:
    """The embedded tiny config cut to 2 layers (GDN + PLE, then QSA), 4 experts: spawned ranks start faster."""
    raw = json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())
    raw.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], ple_layer_ids=[1])
    raw.update(num_experts=4, vocab_size=256)
    return parse_config(raw).text


def micro_batch(step: int, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global micro-batch: SEQS (ids, labels) pairs; labels hide each sequence's first 3 tokens."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    vocab = small_model_config().vocab_size
    out = []
    for n in torch.randint(7, 24, (SEQS,), generator=g).tolist():
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[:3] = -100
        out.append((ids, labels))
    return out


def pack(pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = [len(i) for i, _ in pairs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat([i for i, _ in pairs]), torch.cat([lab for _, lab in pairs]), cu


def step_label_count(step: int) -> int:
    return sum(count_label_tokens(*pack([pair])[1:]) for m in range(MICRO) for pair in micro_batch(step, m))


def train_steps(model, opt, steps, rank: int = 0, world: int = 1) -> list[tuple[float, float]]:
    """Run `steps` (an iterable of step indices); returns [(global loss, grad norm before clipping)]."""
    out = []
    for step in steps:
        count = step_label_count(step)
        total = torch.zeros(())
        for m in range(MICRO):
            ids, labels, cu = pack(micro_batch(step, m)[rank::world])
            loss = sft_loss(model(ids, cu_seqlens=cu).logits, labels, cu, count)
            loss.backward()
            total += loss.detach()
        norm = clip_grad_norm_distributed(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.all_reduce(total)
        out.append((float(total), float(norm)))
    return out


def new_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter as the full tensor (collective: FSDP gathers and the tables' local rows all-gathered)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, OwnerRoutedEmbedding)}
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = p.full_tensor().detach().clone()
        elif id(p) in tables:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, p.detach().clone())
            out[name] = torch.cat(parts)
        else:
            out[name] = p.detach().clone()
    return out


@functools.cache
def reference_muon_step() -> tuple[dict, dict]:
    model = FlashNextForCausalLM(small_model_config())
    model.init_weights(SEED)
    model = parallelize(model, None, ParallelConfig(ac=True))
    delta, report, _ = muon_step(model)
    return delta, report


@functools.cache
def reference_run() -> dict:
    """Unsharded single-process run (no process group): init, the params after SAVE_AFTER and after STEPS steps."""
    model = FlashNextForCausalLM(small_model_config())
    model.init_weights(SEED)
    model = parallelize(model, None, ParallelConfig(ac=True))
    init = full_params(model)
    opt = new_optimizer(model)
    log = train_steps(model, opt, range(SAVE_AFTER))
    mid = full_params(model)
    log += train_steps(model, opt, range(SAVE_AFTER, STEPS))
    return {"init": init, "mid": mid, "final": full_params(model), "log": log}


def muon_step(model, rank: int = 0, world: int = 1) -> tuple[dict, dict, dict]:
    """One step of `build_optimizer`'s Muon / ExpertMuon / AdamW (made shard-aware): (param deltas, report, opts).

    The report also counts, under "ns_matrices", the [m, n] matrices this rank orthogonalised."""
    import flashnext.muon as optim_module

    optimizers, report = build_optimizer(model, OptimConfig(lr=1e-3, muon_lr=0.02, max_grad_norm=0))
    shard_aware_optimizers(optimizers)
    before = full_params(model)
    count = step_label_count(0)
    for m in range(MICRO):
        ids, labels, cu = pack(micro_batch(0, m)[rank::world])
        sft_loss(model(ids, cu_seqlens=cu).logits, labels, cu, count).backward()
    ns = optim_module.batched_newton_schulz
    matrices = []

    def counting(grad, *args, **kwargs):
        matrices.append(grad.shape[0])
        return ns(grad, *args, **kwargs)

    optim_module.batched_newton_schulz = counting
    try:
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        optim_module.batched_newton_schulz = ns
    after = full_params(model)
    return {k: after[k] - before[k] for k in after}, {**report, "ns_matrices": sum(matrices)}, optimizers


def full_optim_state(model, optimizers) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor as a full tensor, keyed `<optimizer>.<param>.<state>` (collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, OwnerRoutedEmbedding)}
    out = {}
    for opt_name, opt in optimizers.items():
        for p, st in opt.state.items():
            for key, v in st.items():
                if isinstance(v, DTensor):
                    v = v.full_tensor()
                elif id(p) in tables and v.shape == p.shape:
                    parts = [None] * dist.get_world_size()
                    dist.all_gather_object(parts, v.detach().clone())
                    v = torch.cat(parts)
                out[f"{opt_name}.{names[id(p)]}.{key}"] = v.detach().clone()
    return out


def meta_parallel_model(seed: int | None, mesh) -> FlashNextForCausalLM:
    with torch.device("meta"):
        model = FlashNextForCausalLM(small_model_config())
    return parallelize(model, mesh, ParallelConfig(ac=True, seed=seed))


def run_rank(rank: int, world: int, root: str, restore_from: str | None = None) -> dict:
    ctx = init_distributed()
    assert (ctx.rank, ctx.world_size, ctx.device.type) == (rank, world, "cpu")
    root = Path(root)
    model = meta_parallel_model(SEED, ctx.mesh)
    init = full_params(model)
    materialised = FlashNextForCausalLM(small_model_config())  # e.g. from_pretrained on every rank
    materialised.init_weights(SEED)
    materialised = parallelize(materialised, ctx.mesh, ParallelConfig(ac=True))
    materialised_init = full_params(materialised)
    del materialised
    opt = new_optimizer(model)
    log = train_steps(model, opt, range(SAVE_AFTER), rank, world)
    mid = full_params(model)
    ckpt = root / f"ckpt_ws{world}"
    save_state(ckpt, model, {"adamw": opt}, extra={"step": SAVE_AFTER, "note": "hello"})
    log += train_steps(model, opt, range(SAVE_AFTER, STEPS), rank, world)
    final = full_params(model)

    # A fresh model, different init (seed 99), restored from the checkpoint, continues one step.
    fresh = meta_parallel_model(99, ctx.mesh)
    fresh_opt = new_optimizer(fresh)
    extra = load_state(ckpt, fresh, {"adamw": fresh_opt})
    restored_mid = full_params(fresh)
    resumed_log = train_steps(fresh, fresh_opt, range(SAVE_AFTER, STEPS), rank, world)
    resumed_final = full_params(fresh)

    files = export_pretrained(model, root / f"export_ws{world}")

    # build_optimizer's Muon/ExpertMuon/AdamW on FSDP2 shards, then a save/load round trip of their states.
    muon_model = meta_parallel_model(SEED, ctx.mesh)
    muon_delta, muon_report, muon_opts = muon_step(muon_model, rank, world)
    save_state(root / f"muon_ws{world}", muon_model, muon_opts)
    muon_states = full_optim_state(muon_model, muon_opts)
    again = meta_parallel_model(None, ctx.mesh)
    again_opts = shard_aware_optimizers(build_optimizer(again, OptimConfig())[0])
    load_state(root / f"muon_ws{world}", again, again_opts)
    muon_restored = (full_params(again), full_optim_state(again, again_opts), full_params(muon_model))
    out = {"log": log, "resumed_log": resumed_log, "extra": extra, "files": [f.name for f in files]}
    tables = [m for m in model.modules() if isinstance(m, OwnerRoutedEmbedding)]
    out["table_ranges"] = [(m.row_start, m.row_end, m.weight.shape[0]) for m in tables]
    out["param_counts"] = (*parameter_counts(model), sum(p.numel() for p in model.parameters()))
    if restore_from is not None:  # a checkpoint written at another world size
        other = meta_parallel_model(None, ctx.mesh)
        other_opt = new_optimizer(other)
        load_state(restore_from, other, {"adamw": other_opt})
        out["other_mid"] = full_params(other)
        out["other_log"] = train_steps(other, other_opt, range(SAVE_AFTER, STEPS), rank, world)
    out["ns_matrices"] = muon_report["ns_matrices"]
    if rank == 0:
        out.update(muon_delta=muon_delta, muon_states=muon_states, muon_restored=muon_restored)
        out.update(
            init=init,
            materialised_init=materialised_init,
            mid=mid,
            final=final,
            restored_mid=restored_mid,
            resumed_final=resumed_final,
        )
    return out
