"""The memory plan of a training run, checked before the model is built or loaded (one process).

The weights come from `flashnext.plan` (the same manifest and table rules as `flashnext plan`), in `model.dtype`;
a run adds per trainable parameter its gradient (in `model.dtype`: the fp32 accumulators of bf16 compute) and its
optimizer state (`train.optim.classify`: Muon and the per-expert Muon keep one momentum buffer, AdamW two moments,
the frozen QSA indexer and frozen n-gram tables none), and with bf16 compute over fp32 masters a bf16 copy of
every fp32 parameter (`train.precision`). Activations are not counted (they depend on the packing; see
`train.activation_checkpointing`). Under torchrun every rank holds a shard, so the check runs in one process only.
"""

from __future__ import annotations

import torch

from flashnext.config import ModelConfig
from flashnext.errors import ConfigError
from flashnext.manifest import TABLE, parameters
from flashnext.plan import (
    DTYPE_BYTES,
    Plan,
    PlanOptions,
    Row,
    StoredAs,
    format_plan,
    machine_capacity,
    shortfall,
    stored_as,
    weight_rows,
)
from flashnext.train.config import RunConfig
from flashnext.train.optim import ADAMW_DECAY, ADAMW_NO_DECAY, FROZEN, MTP_DECAY, MTP_NO_DECAY, classify

_STATES = {FROZEN: 0, ADAMW_DECAY: 2, ADAMW_NO_DECAY: 2, MTP_DECAY: 2, MTP_NO_DECAY: 2}  # others (Muon): 1
_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def training_plan(cfg: RunConfig, model_cfg: ModelConfig, stored: StoredAs, device: str) -> Plan:
    """The plan of a run of `cfg` on `model_cfg` (weights, gradients, optimizer state, bf16 copies)."""
    dtype = _NAMES[cfg.model.dtype]
    storage = cfg.model.ngram_storage
    if storage == "auto":  # as train.setup.build_model resolves it
        storage = "stored" if cfg.model.freeze_ngram else "dense"
    opts = PlanOptions(
        dtype=dtype, ngram_storage=storage, ngram_resident_mb=cfg.model.ngram_resident_mb, max_slots=0, device=device
    )
    plan = Plan(weight_rows(model_cfg, opts, StoredAs(table_dtype=stored.table_dtype)), device=device)
    b = DTYPE_BYTES[dtype]
    grads = states = 0
    for p in parameters(model_cfg):
        if p.kind == TABLE and (cfg.model.freeze_ngram or storage != "dense"):
            continue  # frozen (or not a parameter at all): no gradient, no optimizer state
        group = classify(p.name, torch.empty(p.shape, device="meta"))
        if group == FROZEN:
            continue
        grads += p.numel * b
        states += _STATES.get(group, 1) * p.numel * b
    plan.rows.append(Row("gradients", grads, note=f"{dtype}, trainable parameters"))
    plan.rows.append(Row("optimizer state", states, note="Muon: 1 buffer, AdamW: 2"))
    if dtype == "fp32" and cfg.train.compute_dtype == "bfloat16":
        copies = sum(p.numel for p in parameters(model_cfg) if p.kind != TABLE or storage == "dense") * 2
        plan.rows.append(Row("bf16 compute copies", copies, note="train.precision"))
    return plan


def check_training_plan(cfg: RunConfig, model_cfg: ModelConfig, device: torch.device) -> None:
    """Print the run's plan (on stdout: stderr keeps a failed run to its one error line); a one-line
    `ConfigError` when it cannot fit this machine, unless `train.ignore_memory_plan`."""
    stored = stored_as(cfg.model.path, _raw(cfg.model.path)) if cfg.model.path else StoredAs()
    plan = training_plan(cfg, model_cfg, stored, str(device))
    cap = machine_capacity(str(device))
    title = f"memory plan of the run (model.dtype {cfg.model.dtype} on {device}; activations not included):"
    print(format_plan(plan, cap, title), flush=True)
    why = shortfall(plan, cap)
    if why is not None and not cfg.train.ignore_memory_plan:
        raise ConfigError(
            f"the model cannot fit: {why} (see the plan above; freeze the n-gram tables with "
            "--model.freeze_ngram=true --model.ngram_storage=mmap, or pass --train.ignore_memory_plan=true)"
        )


def _raw(path: str) -> dict:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
