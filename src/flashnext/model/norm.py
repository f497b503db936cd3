"""RMS norms of Qwen3.8-Flash-Next."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm scaling by `(1 + weight)` in fp32, optionally per group of `group_size` features.

    With `group_size`, a `[..., hc * D]` vector is normalised as hc separate `D`-vectors (one per stream).
    """

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        size = self.group_size or h.shape[-1]
        h = F.rms_norm(h.unflatten(-1, (-1, size)), (size,), eps=self.eps).flatten(-2)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain `weight` scale) followed by an activation gate: `w * norm(x) * act(gate)`."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        h = self.weight * h.to(dtype)
        act = F.silu if self.activation == "silu" else torch.sigmoid
        return (h * act(gate.float())).to(dtype)
