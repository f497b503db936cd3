"""Optimizers for training: Muon for hidden matrices (per expert for stacked experts), AdamW for the rest.

Parameter groups (by name and shape, see `classify`):
- `muon`: every 2-D weight inside the decoder (attention, GDN and shared-expert projections, router, PLE
  projections, hyper-connection mixers) -> `Muon`: torch's Muon update (bit-identical to `torch.optim.Muon` with
  bf16 Newton–Schulz), issued as one batched iteration per matrix shape.
- `muon_experts`: the stacked expert weights `mlp.experts.gate_up_proj [E, 2I, D]` / `down_proj [E, D, I]` ->
  `ExpertMuon`, which orthogonalises each expert's `[m, n]` slice on its own (one expert's update never depends
  on another expert's gradient, as if each expert were its own `nn.Linear`).
- `adamw_decay`: `embed_tokens`, every n-gram table, `lm_head` and the depthwise conv kernels `[C, 1, K]`.
- `adamw_no_decay`: norms, biases, `A_log`, `dt_bias` and every other 1-D parameter.
- `frozen`: the QSA indexer (`...self_attn.indexer.*`). It only chooses which blocks a query attends to; that
  choice is a discrete top-k, so no gradient reaches it. It is set to `requires_grad_(False)` and put in no
  optimizer (weight decay would otherwise shrink it although the loss never moves it).
- `mtp_decay` / `mtp_no_decay`: the MTP draft head (`mtp.*`; its indexer is `frozen` like the trunk's), in an
  optimizer of its own: AdamW (decay on ndim >= 2) at `mtp_lr`. It is trained by its own loss
  (`train.mtp_loss_weight`), usually on top of a trained trunk, so its step size is set apart from the trunk's;
  while that loss is off its parameters get no gradient and AdamW leaves them untouched (no decay either).
- The composite model's decoder (`model.language_model.*`) follows the rules above as if it were `model.*`.
  Its vision tower (`model.visual.*`) goes to AdamW: `adamw_decay` for every tensor with ndim >= 2 (block and
  merger matrices, the position table, the 5-D patch-embedding kernel), `adamw_no_decay` for 1-D ones. AdamW
  is the usual regime for fine-tuning a pretrained ViT, and it needs no 2-D view of the Conv3d-shaped kernel.
  A tower frozen with `freeze_vision()` (`requires_grad=False`) is reported `frozen` and put in no optimizer.
- n-gram tables frozen with `model.freeze_ngram` (`requires_grad=False`) are reported `frozen` too; tables kept in
  their stored dtype or read from disk have no parameters at all.

Weight decay follows common practice: decoupled decay (`p *= 1 - lr * weight_decay` per step, in both Muon and
AdamW) on matrices and tables (ndim >= 2, embeddings and `lm_head` included), none on 1-D parameters, whose scale
(norm gains, decay rates) is meaningful in itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from flashnext.errors import ConfigError, FieldsError
from flashnext.muon import ExpertMuon, Muon, batched_newton_schulz  # noqa: F401  (batched_newton_schulz: re-export)

FROZEN, MUON, MUON_EXPERTS = "frozen", "muon", "muon_experts"
ADAMW_DECAY, ADAMW_NO_DECAY = "adamw_decay", "adamw_no_decay"
MTP_DECAY, MTP_NO_DECAY = "mtp_decay", "mtp_no_decay"
_ADAMW_MATRICES = ("embed_tokens.", "lm_head.", "ngram_embedding.")


class OptimConfig(BaseModel):
    """Optimizer, clipping and learning-rate schedule of a training run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(3e-4, ge=0)
    """Peak learning rate of the AdamW groups (embeddings, n-gram tables, lm_head, norms, 1-D parameters)."""
    muon_lr: float = Field(0.02, ge=0)
    """Peak learning rate of the Muon groups (hidden matrices and per-expert slices)."""
    mtp_lr: float | None = Field(None, ge=0)
    """Peak learning rate of the MTP head's AdamW (its own optimizer); None: `lr`."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay on matrices and tables (ndim >= 2); 1-D parameters get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon momentum (Nesterov)."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of Muon's Newton–Schulz iteration: `bfloat16` is torch's (bit-identical to `torch.optim.Muon`);
    `float32` suits CPUs without native bf16 matmuls; `auto` picks bf16 on CUDA and fp32 elsewhere."""
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"
    """Muon's per-shape lr scaling: `original` sqrt(max(1, rows/cols)), or `match_rms_adamw` 0.2 sqrt(max dim)."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Clip the global gradient norm (over all trainable parameters) to this; 0 disables clipping."""
    warmup_steps: int = Field(0, ge=0)
    """Steps of linear warmup from lr/warmup_steps to the peak."""
    total_steps: int = Field(1000, ge=1)
    """Total optimizer steps; the schedule reaches `min_lr_ratio * lr` here and stays there."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup: cosine or linear down to `min_lr_ratio`, or constant at the peak."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""

    @model_validator(mode="after")
    def _check_steps(self) -> OptimConfig:
        if self.warmup_steps > self.total_steps:
            raise FieldsError(
                f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}",
                ("warmup_steps", "total_steps"),
            )
        for i, b in enumerate(self.betas):
            if not 0 <= b < 1:
                raise ValueError(f"betas[{i}]={b} must be in [0, 1)")
        return self


def classify(name: str, p: torch.Tensor) -> str:
    """Group of one parameter by its state-dict name and shape (see the module docstring)."""
    if name.startswith("model.visual."):
        return ADAMW_DECAY if p.ndim >= 2 else ADAMW_NO_DECAY
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    if ".self_attn.indexer." in name:
        return FROZEN
    if name.startswith("mtp."):
        return MTP_DECAY if p.ndim >= 2 else MTP_NO_DECAY
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return MUON_EXPERTS
    if name.startswith(_ADAMW_MATRICES) or any(f".{key}" in name for key in _ADAMW_MATRICES):
        return ADAMW_DECAY
    if p.ndim <= 1:
        return ADAMW_NO_DECAY
    if p.ndim == 3 and p.shape[1] == 1:  # depthwise conv kernel [C, 1, K]: per-channel filters, not a matrix
        return ADAMW_DECAY
    if p.ndim == 2 and name.startswith("model.layers."):
        return MUON
    if p.ndim == 2 and name.startswith("model.hyper_connection_mixer."):
        return MUON
    raise ConfigError(f"no optimizer group for parameter {name!r} of shape {tuple(p.shape)}")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[dict[str, torch.optim.Optimizer], dict[str, str]]:
    """Freeze the QSA indexer and build one optimizer per kind of parameter.

    Returns:
        optimizers: `{"muon": Muon, "muon_experts": ExpertMuon, "adamw": AdamW, "mtp": AdamW}` (an entry is left
            out when it would hold no parameter); the AdamW optimizers have param groups `adamw_decay` /
            `adamw_no_decay` and `mtp_decay` / `mtp_no_decay` (`group["name"]`).
        report: `{param_name: group}` for every parameter, `frozen` for the indexer.
    """
    report: dict[str, str] = {}
    members: dict[str, list[torch.Tensor]] = {
        g: [] for g in (MUON, MUON_EXPERTS, ADAMW_DECAY, ADAMW_NO_DECAY, MTP_DECAY, MTP_NO_DECAY)
    }
    for name, p in model.named_parameters():
        group = classify(name, p)
        if name.startswith("model.visual.") and not p.requires_grad:
            group = FROZEN  # a frozen vision tower (freeze_vision): no optimizer state
        if ".ngram_embedding." in name and not p.requires_grad:
            group = FROZEN  # frozen n-gram tables (model.freeze_ngram): no optimizer state
        report[name] = group
        if group == FROZEN:
            p.requires_grad_(False)
        elif p.requires_grad:
            members[group].append(p)
    ns_dtype = cfg.muon_ns_dtype
    if ns_dtype == "auto":
        on_cuda = any(p.is_cuda for p in model.parameters())
        ns_dtype = "bfloat16" if on_cuda else "float32"
    muon_kwargs = dict(
        ns_dtype=getattr(torch, ns_dtype),
        lr=cfg.muon_lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        adjust_lr_fn=cfg.muon_adjust_lr_fn,
    )
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if members[MUON]:
        optimizers[MUON] = Muon(members[MUON], **muon_kwargs)
    if members[MUON_EXPERTS]:
        optimizers[MUON_EXPERTS] = ExpertMuon(members[MUON_EXPERTS], **muon_kwargs)
    adamw_groups = [
        {"params": members[ADAMW_DECAY], "weight_decay": cfg.weight_decay, "name": ADAMW_DECAY},
        {"params": members[ADAMW_NO_DECAY], "weight_decay": 0.0, "name": ADAMW_NO_DECAY},
    ]
    adamw_groups = [g for g in adamw_groups if g["params"]]
    if adamw_groups:
        optimizers["adamw"] = torch.optim.AdamW(adamw_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    mtp_groups = [
        {"params": members[MTP_DECAY], "weight_decay": cfg.weight_decay, "name": MTP_DECAY},
        {"params": members[MTP_NO_DECAY], "weight_decay": 0.0, "name": MTP_NO_DECAY},
    ]
    mtp_groups = [g for g in mtp_groups if g["params"]]
    if mtp_groups:
        lr = cfg.lr if cfg.mtp_lr is None else cfg.mtp_lr
        optimizers["mtp"] = torch.optim.AdamW(mtp_groups, lr=lr, betas=cfg.betas, eps=cfg.eps)
    return optimizers, report


def lr_lambda(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak lr after `step` optimizer steps: linear warmup, then cosine/linear/constant.

    Warmup gives `(step + 1) / warmup_steps` (the first update is not wasted at lr 0); the decay runs from the
    peak at `warmup_steps` to `min_lr_ratio` at `total_steps` and stays there.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


class Schedulers:
    """One `LambdaLR` per optimizer, stepped together; state dicts keyed like the optimizers."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], cfg: OptimConfig):
        self.schedulers = {
            name: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_lambda(step, cfg))
            for name, opt in optimizers.items()
        }

    def step(self) -> None:
        for s in self.schedulers.values():
            s.step()

    def last_lrs(self) -> dict[str, float]:
        """Current lr of every optimizer's first param group (Muon and AdamW peaks differ)."""
        return {name: s.get_last_lr()[0] for name, s in self.schedulers.items()}

    def state_dict(self) -> dict[str, dict]:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])


def trainable_params(optimizers: dict[str, torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every parameter held by the optimizers, in a fixed order."""
    return [p for opt in optimizers.values() for g in opt.param_groups for p in g["params"]]


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of `params` (all optimizers together) in place; returns the norm before.

    `max_norm <= 0` only measures the norm.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    return torch.nn.utils.clip_grad_norm_(list(params), limit)
