"""parallelize + FSDP2 + owner-routed tables, DCP checkpoints and streamed export, against the unsharded run.

One spawned gloo group per world size runs the whole scenario of `parallel_cases.run_rank` (spawning costs seconds,
the checks milliseconds); the tests read its results. World size 2 is in the fast suite; the spawned world of 1
and world size 4 are `slow` (the single-process, no-process-group path is covered in-process here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import parallel_cases as pc
import pytest
import torch
from dist_helpers import spawned_once

import flashnext
from flashnext.errors import CheckpointError
from flashnext.model.text import FlashNextForCausalLM
from flashnext.parallel import (
    ParallelConfig,
    clip_grad_norm_distributed,
    load_state,
    parallelize,
    row_ranges,
    save_state,
)

_RESULTS: dict[int, list[dict] | RuntimeError] = {}
TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box's cores are shared; one thread is faster for this tiny model
    try:
        return pc.reference_run()
    finally:
        torch.set_num_threads(threads)


def results(world: int, root: Path) -> list[dict]:
    restore_from = None
    if world != 2:
        results(2, root)  # the other worlds restore its checkpoint
        restore_from = str(root / "ckpt_ws2")
    return spawned_once(_RESULTS, world, pc.run_rank, world, str(root), restore_from, timeout_s=300)


WORLDS = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]


def _max_err(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _bitwise(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", WORLDS)
def test_meta_init_equals_unsharded_init_weights(world, root, reference):
    r = results(world, root)[0]
    assert _bitwise(r["init"], reference["init"]) == []


@pytest.mark.parametrize("world", WORLDS)
def test_materialised_model_is_sliced_and_sharded_in_place(world, root, reference):
    r = results(world, root)[0]
    assert _bitwise(r["materialised_init"], reference["init"]) == []


@pytest.mark.parametrize("world", WORLDS)
def test_three_adamw_steps_equal_unsharded_run(world, root, reference):
    """2 micro-batches, AC on, clipping active (norm > MAX_NORM): losses, norms and parameters match."""
    for res in results(world, root):
        for (loss, norm), (ref_loss, ref_norm) in zip(res["log"], reference["log"], strict=True):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
            assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
            assert ref_norm > pc.MAX_NORM  # the clip coefficient matters
    r = results(world, root)[0]
    assert _max_err(r["mid"], reference["mid"]) <= 1e-5
    assert _max_err(r["final"], reference["final"]) <= 1e-5
    assert _max_err(r["final"], reference["init"]) > 1e-3  # the steps did move the parameters


@pytest.mark.parametrize("world", WORLDS)
def test_tables_hold_local_rows_only(world, root):
    res = results(world, root)
    rows = res[0]["final"][TABLE].shape[0]
    assert [r["table_ranges"] for r in res] == [[(a, b, b - a)] for a, b in row_ranges(rows, world)]


@pytest.mark.parametrize("world", WORLDS)
def test_parameter_count_is_the_whole_models_at_any_world_size(world, root):
    """`parameter_counts` gives every rank the unsharded model's count (what one process prints), and the ranks'
    shares add up to it; summing `numel()` over the parameters does not (it sees only the local table rows)."""
    with torch.device("meta"):
        whole = sum(p.numel() for p in FlashNextForCausalLM(pc.small_model_config()).parameters())
    counts = [r["param_counts"] for r in results(world, root)]
    assert [total for total, _, _ in counts] == [whole] * world
    assert sum(local for _, local, _ in counts) == whole
    if world > 1:
        assert all(local < whole and naive < whole for _, local, naive in counts)


@pytest.mark.parametrize("world", WORLDS)
def test_dcp_restore_is_exact(world, root):
    """A fresh model (other init) restored from the step-2 checkpoint continues exactly like the uninterrupted run."""
    for res in results(world, root):
        assert res["extra"] == {"step": pc.SAVE_AFTER, "note": "hello"}
        assert res["resumed_log"] == res["log"][pc.SAVE_AFTER :]
    r = results(world, root)[0]
    assert _bitwise(r["restored_mid"], r["mid"]) == []
    assert _bitwise(r["resumed_final"], r["final"]) == []
    assert not (root / f"ckpt_ws{world}.tmp").exists()


@pytest.mark.parametrize("world", WORLDS)
def test_muon_and_expert_muon_step_on_fsdp_shards(world, root):
    """build_optimizer's groups after shard_aware_optimizers: every update lands and matches the unsharded step.

    Muon's Newton-Schulz runs in bf16, so fp32 reduction-order differences in the gradient can flip bf16 roundings
    of single entries (one bf16 ulp of an orthogonalised entry times the lr, ~2.4% of the largest update seen): Muon
    updates are compared at 5% of their largest entry and 1% in Frobenius norm, AdamW ones at 1e-5.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_delta, report = pc.reference_muon_step()
    finally:
        torch.set_num_threads(threads)
    delta = results(world, root)[0]["muon_delta"]
    assert {report[k] for k in delta} >= {"muon", "muon_experts", "adamw_decay", "adamw_no_decay", "frozen"}
    for name, ref in ref_delta.items():
        scale, err = float(ref.abs().max()), float((delta[name] - ref).abs().max())
        if report[name] == "frozen":
            assert scale == 0 and float(delta[name].abs().max()) == 0, name
        elif report[name].startswith("muon"):
            fro = float((delta[name] - ref).norm() / ref.norm())
            assert scale > 0 and err <= 0.05 * scale and fro <= 0.01, (name, err, scale, fro)
        else:
            assert err <= 1e-5 * max(scale, 1.0), (name, err, scale)


@pytest.mark.parametrize("world", WORLDS)
def test_muon_orthogonalises_each_matrix_once_across_ranks(world, root):
    """Newton-Schulz runs on each matrix's owner rank only: the ranks' counts add up to one process's count, and
    the work is dealt out (no rank does it all once there is more than one matrix per rank)."""
    _, report = pc.reference_muon_step()
    counts = [r["ns_matrices"] for r in results(world, root)]
    assert sum(counts) == report["ns_matrices"] > 0
    if world > 1:
        assert max(counts) < report["ns_matrices"]


@pytest.mark.parametrize("world", WORLDS)
def test_muon_states_round_trip_through_dcp(world, root):
    r = results(world, root)[0]
    params, states, saved_params = r["muon_restored"]
    assert any(".momentum_buffer" in k for k in r["muon_states"])
    assert _bitwise(states, r["muon_states"]) == []
    assert _bitwise(params, saved_params) == []


def test_dcp_restore_from_world_2_onto_single_process(root, reference):
    """No process group: the ws-2 checkpoint (tables as row shards) restores into a plain model and trains on."""
    saved = results(2, root)[0]
    with torch.device("meta"):
        model = FlashNextForCausalLM(pc.small_model_config())
    model = parallelize(model, None, ParallelConfig(ac=True, seed=None))
    opt = pc.new_optimizer(model)
    extra = load_state(root / "ckpt_ws2", model, {"adamw": opt})
    assert extra["step"] == pc.SAVE_AFTER
    assert _bitwise(pc.full_params(model), saved["mid"]) == []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        log = pc.train_steps(model, opt, range(pc.SAVE_AFTER, pc.STEPS))
    finally:
        torch.set_num_threads(threads)
    (loss, norm), (ref_loss, ref_norm) = log[0], reference["log"][pc.SAVE_AFTER]
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss) and abs(norm - ref_norm) <= 1e-5 * ref_norm
    assert _max_err(pc.full_params(model), reference["final"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_dcp_restore_from_world_2_onto_other_world_size(world, root):
    r2 = results(2, root)[0]
    for rank, res in enumerate(results(world, root)):
        flat = [x for pair in res["other_log"] for x in pair]
        assert flat == pytest.approx([x for pair in r2["log"][pc.SAVE_AFTER :] for x in pair], rel=1e-5)
        if rank == 0:
            assert _bitwise(res["other_mid"], r2["mid"]) == []


@pytest.mark.parametrize("world", WORLDS)
def test_streamed_export_loads_and_equals(world, root):
    out = root / f"export_ws{world}"
    loaded = flashnext.from_pretrained(out)
    r = results(world, root)[0]
    got = {n: p.detach() for n, p in loaded.named_parameters()}
    assert _bitwise(got, r["final"]) == []
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard_files = {k: f for k, f in weight_map.items() if ".ngram_embedding.shard_" in k}
    parts = pc.small_model_config().split_ngram_parts
    assert len(shard_files) == parts and len(set(shard_files.values())) == parts  # a file per shard
    rows = r["final"][TABLE].shape[0]
    ranges = row_ranges(rows, world)
    for j, (a, _) in enumerate(_chunk_rows(rows, parts)):
        owner = next(q for q, (s, e) in enumerate(ranges) if s <= a < e)
        fname = shard_files[f"{TABLE.removesuffix('.weight')}.shard_{j}.weight"]
        writers = [q for q, res in enumerate(results(world, root)) if fname in res["files"]]
        assert writers == [owner], (j, writers, owner)


def _chunk_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    step = -(-rows // parts)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def test_single_process_meta_parallelize_equals_init_weights(reference):
    with torch.device("meta"):
        model = FlashNextForCausalLM(pc.small_model_config())
    model = parallelize(model, None, ParallelConfig(ac=False, seed=pc.SEED))
    assert _bitwise(pc.full_params(model), reference["init"]) == []


def test_clip_grad_norm_distributed_plain_matches_torch():
    g = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_distributed(a, 0.3)
    ref = torch.nn.utils.clip_grad_norm_(b, 0.3)
    assert torch.allclose(ours, ref, rtol=1e-6)
    for p, q in zip(a, b, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_load_state_rejects_missing_and_mismatched(root, tmp_path):
    model = FlashNextForCausalLM(pc.small_model_config())
    opt = pc.new_optimizer(model)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_state(tmp_path / "nothing", model, {"adamw": opt})
    results(2, root)
    with pytest.raises(CheckpointError, match="'sgd'"):
        load_state(root / "ckpt_ws2", model, {"sgd": torch.optim.SGD(model.parameters(), lr=0.1)})


def test_save_state_single_process_replaces_atomically(tmp_path):
    model = FlashNextForCausalLM(pc.small_model_config())
    opt = pc.new_optimizer(model)
    target = tmp_path / "ckpt"
    save_state(target, model, {"adamw": opt}, extra={"v": 1})
    save_state(target, model, {"adamw": opt}, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert load_state(target, model, {"adamw": opt}) == {"v": 2}


def test_compile_hook_is_called_when_asked(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("flashnext.compile")
    fake.compile_model = lambda model: calls.append(type(model).__name__)
    monkeypatch.setitem(sys.modules, "flashnext.compile", fake)
    with torch.device("meta"):
        model = FlashNextForCausalLM(pc.small_model_config())
    parallelize(model, None, ParallelConfig(ac=False, compile=True, seed=None))
    assert calls == ["FlashNextForCausalLM"]
    parallelize(model, None, ParallelConfig(ac=False, compile=False, seed=None))
    assert calls == ["FlashNextForCausalLM"]


def test_parallel_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ParallelConfig(activation_checkpointing=True)
