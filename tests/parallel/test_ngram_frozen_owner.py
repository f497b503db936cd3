"""Frozen FP8 n-gram tables under `parallelize` (owner-routed, FSDP2) in a spawned gloo world of 2.

Each rank loads the same FP8-table checkpoint (the table stays FP8: `StoredNGramTable`), `parallelize` turns it
into a frozen owner-routed table holding its rows in FP8 plus the scale, and owners dequantise the rows they
gather. Checked against one process running the same checkpoint without a process group: losses and logits,
gradients of the other parameters, then one optimizer step, a DCP round trip and the streamed export.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import parallel_cases as pc
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_spawned
from torch.distributed.tensor import DTensor

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize import quantize_checkpoint
from flashnext.model.text import FlashNextForCausalLM
from flashnext.ngram.stored import StoredNGramTable
from flashnext.parallel import (
    OwnerRoutedEmbedding,
    ParallelConfig,
    export_pretrained,
    init_distributed,
    load_state,
    parallelize,
    row_ranges,
    save_state,
    shard_aware_optimizers,
)
from flashnext.train.loss import sft_loss
from flashnext.train.optim import OptimConfig, build_optimizer

TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding"


def _table(model):
    return model.model.layers[0].ple.ple_embedding.ngram_embedding


def _step(model, rank: int, world: int) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Forward + backward of micro-batch (0, 0), this rank's sequences: (global loss, this rank's logits, grads)."""
    count = pc.step_label_count(0) / pc.MICRO  # any fixed denominator shared by every rank
    pairs = pc.micro_batch(0, 0)[rank::world]
    ids, labels, cu = pc.pack(pairs)
    logits = model(ids, cu_seqlens=cu).logits
    loss = sft_loss(logits, labels, cu, count)
    loss.backward()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
    return float(total), list(logits.detach().split(torch.diff(cu).tolist())), grads


def run_rank(rank: int, world: int, ckpt: str, out: str) -> dict:
    ctx = init_distributed()
    model = flashnext.from_pretrained(ckpt)
    assert isinstance(_table(model), StoredNGramTable)
    full = _table(model).weight.clone()
    model = parallelize(model, ctx.mesh, ParallelConfig(ac=True, seed=None))
    table = _table(model)
    lo, hi = row_ranges(full.shape[0], world)[rank]
    result = {
        "frozen": isinstance(table, OwnerRoutedEmbedding) and table.frozen and table.weight.dtype == full.dtype,
        "rows_exact": torch.equal(table.weight.view(torch.uint8), full[lo:hi].view(torch.uint8)),
        "table_params": [n for n, _ in model.named_parameters() if "ngram_embedding" in n],
    }
    loss, logits, grads = _step(model, rank, world)
    result.update(loss=loss, logits=logits, grads=grads, table_grad=table.weight.grad)
    optimizers, _ = build_optimizer(model, OptimConfig(lr=1e-3, max_grad_norm=0))
    shard_aware_optimizers(optimizers)
    for opt in optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_state(Path(out) / "dcp", model, optimizers, extra={})
    fresh = parallelize(flashnext.from_pretrained(ckpt), ctx.mesh, ParallelConfig(ac=True, seed=None))
    fresh_opts, _ = build_optimizer(fresh, OptimConfig(lr=1e-3, max_grad_norm=0))
    shard_aware_optimizers(fresh_opts)
    load_state(Path(out) / "dcp", fresh, fresh_opts)
    result["dcp_rows_exact"] = torch.equal(_table(fresh).weight.view(torch.uint8), table.weight.view(torch.uint8))
    result["dcp_params_exact"] = all(
        torch.equal(a.full_tensor() if isinstance(a, DTensor) else a, b.full_tensor() if isinstance(b, DTensor) else b)
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    export_pretrained(model, Path(out) / "export")
    return pickle.loads(pickle.dumps(result))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("frozen_fp8")
    model = FlashNextForCausalLM(pc.small_model_config())
    model.init_weights(pc.SEED)
    save_pretrained(model.to(torch.bfloat16), root / "bf16")
    quantize_checkpoint(root / "bf16", root / "fp8")
    return root


def test_owner_routed_frozen_fp8_table_at_world_2(fp8_checkpoint):
    root = fp8_checkpoint
    ranks = run_spawned(run_rank, 2, str(root / "fp8"), str(root), timeout_s=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = flashnext.from_pretrained(root / "fp8")
        ref_loss, ref_logits, ref_grads = _step(ref, 0, 1)
    finally:
        torch.set_num_threads(threads)
    for r in ranks:
        assert r["frozen"] and r["rows_exact"] and r["table_params"] == [] and r["table_grad"] is None
        assert r["dcp_rows_exact"] and r["dcp_params_exact"]
    # Different processes and sequence splits: equal up to fp32 rounding, not bitwise.
    assert ranks[0]["loss"] == pytest.approx(ref_loss, rel=1e-5) and ranks[1]["loss"] == ranks[0]["loss"]
    by_rank = [ranks[i % 2]["logits"][i // 2] for i in range(len(ref_logits))]  # sequences r::2 went to rank r
    for ours, want in zip(by_rank, ref_logits, strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)
    assert set(ranks[0]["grads"]) == set(ref_grads)
    for name, g in ref_grads.items():  # FSDP gathered full gradients: the sum over both ranks' sequences
        torch.testing.assert_close(ranks[0]["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)

    src = flashnext.from_pretrained(root / "fp8")
    exported = flashnext.from_pretrained(root / "export")
    a, b = _table(src), _table(exported)
    assert isinstance(b, StoredNGramTable) and torch.equal(b.weight.view(torch.uint8), a.weight.view(torch.uint8))
    assert torch.equal(b.weight_scale, a.weight_scale)
