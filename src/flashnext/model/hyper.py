"""Hyper-connections: `hc` residual streams mixed into one block input, and the block output injected back.

Legend: T tokens, hc streams, D hidden size; the residual is `[T, hc * D]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.model.fused import Group, apply_linear
from flashnext.model.norm import RMSNorm
from flashnext.model.state import TRAIN_STEP, Step


class GatedResidual(nn.Module):
    """Gated mixer of `hc` streams. With `inject=True` also returns the per-stream injection weights."""

    def __init__(self, hidden_size: int, hc_count: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hc = hc_count
        self.hidden = hidden_size
        width = hc_count * hidden_size
        self.hc_norm = RMSNorm(width, group_size=hidden_size, eps=eps)
        self.input_mix_weight_down = nn.Linear(width, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, hc_count, bias=False) if inject else None
        self.down = Group(*(m for m in (self.input_mix_weight_down, self.block_inject_weight) if m is not None))

    def forward(self, residual: torch.Tensor, step: Step = TRAIN_STEP):
        """residual: [T, hc*D] -> mixed input [T, D] (and injection weights [T, hc] when injecting).

        `step` (`model.state.Step`): a serving step takes the fast paths of `model.fused` (prepared weights)."""
        fused = step.fused
        normed = self.hc_norm(residual)
        if self.block_inject_weight is None:
            (down,) = self.down(normed, fused)
        else:
            down, inject = self.down(normed, fused)
        mix = F.silu(down / self.hc)
        mix = torch.sigmoid(apply_linear(self.input_mix_weight_up, mix, fused)).unflatten(-1, (self.hc, self.hidden))
        mixed = (mix * normed.unflatten(-1, (self.hc, self.hidden))).mean(-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(inject / self.hc)


def inject(residual: torch.Tensor, block_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """residual [T, hc*D] + block_out [T, D] scaled per stream by weights [T, hc]."""
    return residual + (block_out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
