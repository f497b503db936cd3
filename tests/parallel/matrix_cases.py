"""Per-rank body of the training feature matrix (`test_training_matrix.py`) and its one-process references.

A cell is (loss, layout, MTP loss, n-gram tables): `loss` sft | rl, `layout` fsdp2 (two data-parallel ranks) | cp2
(one context-parallel group of two ranks, FSDP2 over both), `mtp` off | on (`train.mtp_loss_weight`), `tables`
trainable | frozen (`model.freeze_ngram`). Every distributed cell of one world runs in one spawned gloo group
(spawning costs seconds, a cell's two steps less) and reports its metrics, or the one-line start-up error that
refused it; the reference is `Trainer` in one process taking the same global batch.
"""

from __future__ import annotations

import os

import cp_cases as cc

from flashnext.errors import ConfigError
from flashnext.parallel import init_distributed
from flashnext.train.config import load_run_config
from flashnext.train.trainer import Trainer

MTP_WEIGHT = 0.3


def overrides(cell: tuple[str, str, str, str], data: str, model: str, out_dir: str, one_process: bool) -> list[str]:
    """`cp_cases.trainer_overrides` (the CP tests' run) with the cell's loss, MTP weight and tables, two steps."""
    loss, layout, mtp, tables = cell
    cp = 2 if layout == "cp2" and not one_process else 1
    micro = (2 if layout == "fsdp2" else 1) if one_process else 1  # the world's global batch
    mine = {
        "--train.loss": loss,
        "--train.steps": "2",
        "--train.mtp_loss_weight": str(MTP_WEIGHT if mtp == "on" else 0.0),
        "--model.freeze_ngram": "true" if tables == "frozen" else "false",
    }
    base = [a for a in cc.trainer_overrides(data, out_dir, micro, cp, model) if a.split("=", 1)[0] not in mine]
    return base + [f"{k}={v}" for k, v in mine.items()]


def _name(cell) -> str:
    return "-".join(cell)


def run_cell(cell, data: str, model: str, root: str, one_process: bool, ctx=None) -> dict:
    """The cell's per-step metrics (`history`), or `{"refused": message}` when its start-up refused it."""
    out = f"{root}/{'one' if one_process else 'dist'}-{_name(cell)}"
    try:
        trainer = Trainer(load_run_config(None, overrides(cell, data, model, out, one_process)), ctx)
    except ConfigError as e:
        return {"refused": str(e)}
    return {"history": trainer.run()}


def prepare(root: str) -> tuple[str, str]:
    """The RL-style records (labels, engine log-probs, advantages: SFT reads the labels) and the start checkpoint."""
    return cc.write_rl_data(f"{root}/records.jsonl"), cc.write_checkpoint(f"{root}/start")


def run_rank(rank: int, world: int, root: str, cells: list) -> dict:
    """Every distributed cell of `cells` in this group; rank 0 returns {cell name: result}."""
    import torch.distributed as dist

    if rank == 0:
        os.makedirs(root, exist_ok=True)
        prepare(root)
    dist.barrier()
    ctx = init_distributed()
    results = {}
    for cell in cells:
        res = run_cell(tuple(cell), f"{root}/records.jsonl", f"{root}/start", root, False, ctx)
        results[_name(cell)] = res
        dist.barrier()
    return results if rank == 0 else {}
