"""Muon for hidden matrices and stacked expert weights: torch's update, issued as batched Newton-Schulz per shape.

Used by the trainer (`train.optim.build_optimizer` puts the decoder's matrices here) and by `parallel.optim`, which
runs the same step on gathered full matrices under FSDP2, so it lives below both.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr  # torch's Muon lr-by-shape rule, shared with its 2-D updates

from flashnext.errors import ConfigError


class Muon(torch.optim.Optimizer):
    """torch's Muon update for 2-D matrices and for stacked expert weights `[E, m, n]` (each slice its own matrix).

    Per parameter: Nesterov momentum (`buf.lerp_(grad, 1 - momentum)`, update `grad.lerp(buf, momentum)`), then
    the quintic Newton–Schulz orthogonalisation, torch's lr-by-shape rule and decoupled weight decay — exactly
    `torch.optim.Muon`'s step. What differs is only how the work is issued: every matrix of the same `[m, n]`
    shape in a param group (all E slices of an expert weight, all layers' `q_proj`s, ...) is orthogonalised in one
    batched iteration (`batched_newton_schulz`), so a step issues a few batched matmuls per shape instead of a few
    per matrix. With `ns_dtype=torch.bfloat16` (torch's choice) the result is bit-identical to `torch.optim.Muon`
    (held by `tests/train/test_optim.py`); `torch.float32` runs the same iteration in fp32, for CPUs, where bf16
    matmuls are emulated and several times slower than fp32 ones.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ConfigError(f"Muon takes 2-D or stacked 3-D weights, got shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter (every expert slice) that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                by_shape.setdefault(tuple(p.shape[-2:]), []).append((p, update.reshape(-1, *p.shape[-2:])))
            for (m, n), members in by_shape.items():
                stacked = torch.cat([u for _, u in members]) if len(members) > 1 else members[0][1]
                ortho = batched_newton_schulz(
                    stacked, group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"]
                )
                lr = group["lr"]
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], torch.Size((m, n)))
                for (p, _), o in zip(members, ortho.split([u.shape[0] for _, u in members]), strict=True):
                    p.mul_(1 - lr * group["weight_decay"])
                    p.add_(o.view(p.shape), alpha=-adjusted)
        return loss


class ExpertMuon(Muon):
    """`Muon` restricted to stacked expert weights `[E, m, n]`: each expert's `[m, n]` slice is its own matrix, so
    one expert's update never depends on another expert's gradient."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 3:
                    raise ConfigError(f"ExpertMuon takes stacked [E, m, n] weights, got shape {tuple(p.shape)}")


def batched_newton_schulz(
    grad: torch.Tensor,
    ns_coefficients: tuple[float, float, float],
    ns_steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """torch's Muon orthogonalisation (`torch.optim._muon._zeropower_via_newtonschulz`) of every `[m, n]` slice of
    `grad [B, m, n]` at once: the same quintic iteration in `dtype`, with batched matmuls."""
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    x = x / x.flatten(1).norm(dim=1).clamp(min=eps)[:, None, None]  # each slice's spectral norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x
