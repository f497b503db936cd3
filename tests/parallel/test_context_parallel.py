"""Context parallelism (`parallel/context.py`) against one process: each exchange alone, the model, the trainer.

One spawned gloo group per world size runs `cp_cases.run_rank` (every check; spawning costs seconds); the tests
read its results. World 2 is in the fast suite; world 4 (a CP group of 4 for the model, CP 2 x FSDP 2 for the
trainer, and the `torchrun` launch) is `slow`: world 2 covers the same code paths with one boundary per group.
The layout planning is host math and runs in-process.

Tolerances: fp32 throughout. The split model differs from one process only by summation order (the affine GDN
correction `o0 + resp @ S_in`, per-rank GEMM shapes), so values and gradients agree to <= 1e-5 relative to each
tensor's largest entry, while the QSA selection (discrete) must be identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cp_cases as cc
import pytest
import torch
from dist_helpers import free_port, spawned_once

from flashnext.errors import ConfigError
from flashnext.parallel.context import plan_layout
from flashnext.train.config import load_run_config
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]
_RESULTS: dict[int, list[dict] | RuntimeError] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("context_parallel")


def results(world: int, root: Path) -> list[dict]:
    """Every rank's results of one world size, run once per module (a failed run, once: `spawned_once`)."""
    return spawned_once(_RESULTS, world, cc.run_rank, world, str(root), timeout_s=600)


def one_thread(fn, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box's cores are shared with the spawned ranks' leftovers; tiny model
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("world", WORLDS)
def test_each_exchange_alone_equals_the_unsplit_op(world, root):
    """GDN affine pairs, PLE dilated conv (halo wider than a slice at world 4), GDN short conv, n-gram context,
    QSA blocks + keys/values: outputs and input gradients of the split op against the unsplit one, every rank."""
    for ops in (r["ops"] for r in results(world, root)):
        for name in ("gdn", "ple_conv", "gdn_conv", "qsa_attention"):
            assert ops[name] <= 1e-5, (name, ops[name])
        assert ops["ngram_equal"] == 1.0 and ops["qsa_select_equal"] == 1.0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["packed", "short"])
def test_model_equals_one_process(world, name, root):
    """A packed batch split over a CP group of `world` ranks: logits, loss, every parameter gradient, and each
    query's selected QSA tokens equal the one-process model's."""
    got, ref = results(world, root)[0]["models"][name], one_thread(cc.reference_model_run, name)
    assert rel(got["logits"], ref["logits"]) <= 1e-5
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert got["grads"].keys() == ref["grads"].keys()
    errors = {k: rel(got["grads"][k], g) for k, g in ref["grads"].items()}
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert got["selection"] == ref["selection"]
    assert any(len(s) > 4 for s in ref["selection"])  # queries did choose among blocks


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["packed", "short"])
def test_chunked_head_and_mtp_loss_equal_one_process(world, name, root):
    """The chunked LM head's and the MTP head's loss sums (targets one and two tokens ahead cross the slices'
    edges) and the gradients of their weighted sum, split over a CP group, equal one process's (fp32: the split
    changes only the order of the gathered sums)."""
    got, ref = results(world, root)[0]["heads"][name], one_thread(cc.reference_heads_run, name)
    assert got["loss_sum"] == pytest.approx(ref["loss_sum"], rel=1e-6)
    assert got["mtp_loss_sum"] == pytest.approx(ref["mtp_loss_sum"], rel=1e-6)
    assert got["grads"].keys() == ref["grads"].keys() and any(k.startswith("mtp.") for k in ref["grads"])
    errors = {k: rel(got["grads"][k], g) for k, g in ref["grads"].items()}
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("world", WORLDS)
def test_trainer_cp_steps_equal_one_process(world, root):
    """`parallel.cp = 2` with FSDP2 over the world: three Muon/AdamW steps of the RL loss plus the MTP loss take
    the one-process steps (loss, MTP loss, RL metrics, token counts, grad norm, weights)."""
    res = [r["trainer"] for r in results(world, root)]
    ref = one_thread(cc.reference_trainer_run, str(root), world)
    for a, b in zip(ref["history"], res[0]["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
        assert (b["tokens"], b["loss_tokens"]) == (a["tokens"], a["loss_tokens"])
        for k in (k for k in a if k.startswith("rl/")):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert [h["loss"] for h in res[1]["history"]] == [h["loss"] for h in res[0]["history"]]
    errors = {k: float((res[0]["params"][k] - p).abs().max()) for k, p in ref["params"].items()}
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
def test_torchrun_cp2_fsdp2_equals_one_process(small_config, tmp_path):
    """`torchrun --nproc-per-node 4 -m flashnext train --parallel.cp=2` on gloo: metrics equal one process's."""
    data, model = cc.write_rl_data(str(tmp_path / "rl.jsonl")), cc.write_checkpoint(str(tmp_path / "start"))
    common = [a for a in cc.trainer_overrides(data, "", 1, 1, model) if not a.startswith(("--out_dir", "--parallel"))]
    common = [a.replace("--train.loss=rl", "--train.loss=sft") for a in common]
    Trainer(load_run_config(None, [*common, f"--out_dir={tmp_path / 'a'}", "--data.micro_batches=2"])).run()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "flashnext", "train", *common, f"--out_dir={tmp_path / 'b'}",
           "--parallel.cp=2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, cp = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("a", "b"))
    assert len(cp) == len(one) == 3
    for a, b in zip(one, cp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert (b["tokens"], b["loss_tokens"]) == (a["tokens"], a["loss_tokens"])


# ---- layout (host math) ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lengths, cp, ratio",
    [([3, 61, 2, 7], 2, 4), ([3, 61, 2, 7], 4, 4), ([5, 2, 6], 4, 4), ([0, 9, 0, 2], 2, 4), ([13, 2, 2, 9], 4, 4),
     ([1], 4, 4), ([7, 7, 7, 7, 7], 3, 1), ([4096], 8, 4)],
)  # fmt: skip
def test_layout_cuts_no_block_and_pads_with_inert_segments(lengths, cp, ratio):
    lay = plan_layout(lengths, cp, ratio)
    L, cu = lay.local_len, lay.cu_seqlens
    assert L % ratio == 0 and cu[-1] == cp * L and cu[0] == 0
    real = [i for i in range(len(cu) - 1) if i not in lay.pad_segments]
    assert [cu[i + 1] - cu[i] for i in real] == lengths  # every sequence whole, in order
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if b - a and a // L != (b - 1) // L:  # crosses a rank edge: from a block boundary, so no block straddles
            assert a % ratio == 0 and i not in lay.pad_segments
    ids = torch.arange(sum(lengths)) + 1
    padded = lay.pad(ids, 0)
    assert torch.equal(lay.unpad(padded), ids) and int((padded == 0).sum()) == cp * L - sum(lengths)
    blocks = sum((b - a) // ratio for a, b in zip(cu[:-1], cu[1:], strict=True))
    assert sum(lay.block_counts()) == blocks  # the ranks' own blocks tile the stream's
    # L is the smallest multiple of c that fits: alignment pads at most c - 1 rows per crossing sequence
    assert L == ratio or cp * (L - ratio) < sum(lengths) + (cp - 1) * (ratio - 1)


def test_layout_targets_are_formed_before_slicing():
    lay = plan_layout([3, 9], 2, 4)  # L = 8: the 9-token sequence is moved to row 4 and crosses the edge at row 8
    assert lay.cu_seqlens == [0, 3, 4, 13, 16] and lay.pad_segments == [1, 3]
    targets = lay.targets(torch.arange(12), torch.tensor([0, 3, 12]))
    assert targets[lay.token_rows].tolist() == [1, 2, -100, 4, 5, 6, 7, 8, 9, 10, 11, -100]
    assert targets[7] == 7 and int((targets != -100).sum()) == 10  # row 7 (rank 0) predicts row 8's token (rank 1)


def test_cp_needs_a_launch(small_config, tmp_path):
    from flashnext.train.config import toml_literal

    data = cc.write_rl_data(str(tmp_path / "d.jsonl"), n=4)
    cfg = load_run_config(
        None, [f"--data.path={data}", "--parallel.cp=2", "--model.overrides=" + toml_literal(small_config)]
    )
    with pytest.raises(ConfigError, match="parallel.cp=2"):
        Trainer(cfg)
