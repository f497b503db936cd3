"""The training feature matrix: {SFT, RL} x {FSDP 2, CP 2} x {MTP loss off, on} x {n-gram tables trainable, frozen},
each distributed cell against one process taking the same global batch (two steps of Muon/ExpertMuon/AdamW: loss,
MTP loss, grad norm, token counts), or refused at start-up with a one-line error.

Tolerance: rel 1e-5 on losses and grad norms (the split changes only the order of fp32 sums: FSDP's reduce-scatter,
CP's gathered blocks; the other parallel tests hold the same bound). The diagonal (each value of each axis once)
runs by default in one spawned world of 2; the full product is `slow` (run by `.ci/run`). The one-process column is
each row's reference (and runs in every cell).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import matrix_cases as mc
import pytest
import torch
from dist_helpers import spawned_once

AXES = {
    "loss": ("sft", "rl"),
    "layout": ("fsdp2", "cp2"),
    "mtp": ("off", "on"),
    "tables": ("trainable", "frozen"),
}
DIAGONAL = [("sft", "fsdp2", "on", "frozen"), ("rl", "cp2", "on", "trainable"), ("sft", "cp2", "off", "frozen")]
FULL = [c for c in itertools.product(*AXES.values()) if c not in DIAGONAL]
REFUSED: dict[tuple, str] = {}  # cell -> the start-up error it must raise; none today
_RESULTS: dict[str, list | RuntimeError] = {}


def _distributed(cells: list, root: Path, key: str) -> dict:
    cells = [list(c) for c in cells]
    return spawned_once(_RESULTS, key, mc.run_rank, 2, str(root), cells, timeout_s=900, fresh_dir=root)[0]


def _reference(cell, root: Path) -> dict:
    torch.set_num_threads(1)
    ref = root / "ref"
    if not (ref / "start").exists():
        mc.prepare(str(ref))
    return mc.run_cell(cell, str(ref / "records.jsonl"), str(ref / "start"), str(ref), True)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("matrix")
    (path / "ref").mkdir()
    return path


def check(cell, got: dict, want: dict) -> None:
    if cell in REFUSED:
        assert REFUSED[cell] in got.get("refused", ""), got
        return
    assert "refused" not in got, got["refused"]
    assert len(got["history"]) == len(want["history"]) == 2
    for a, b in zip(want["history"], got["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert (b["tokens"], b["loss_tokens"]) == (a["tokens"], a["loss_tokens"])
        if cell[2] == "on":
            assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=1e-5)
        else:
            assert "mtp_loss" not in b


@pytest.mark.parametrize("cell", DIAGONAL, ids="-".join)
def test_training_matrix_diagonal(cell, root):
    got = _distributed(DIAGONAL, root / "diag", "diag")["-".join(cell)]
    check(cell, got, _reference(cell, root))


@pytest.mark.slow
@pytest.mark.parametrize("cell", FULL, ids="-".join)
def test_training_matrix_full(cell, root):
    got = _distributed(FULL, root / "full", "full")["-".join(cell)]
    check(cell, got, _reference(cell, root))
