"""Partial rotary position embedding (text positions `[T]` or interleaved MRoPE positions `[3, T]`)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Computes cos/sin `[T, rotary_dim]` for positions; the first `rotary_dim` features of a head rotate."""

    def __init__(self, rotary_dim: int, theta: float, mrope_section: list[int] | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.mrope_section = mrope_section or [11, 11, 10]

    def inv_freq(self, device) -> torch.Tensor:
        """fp32 [rotary_dim / 2]; recomputed per call (tiny) so no buffer can be cast to a low precision."""
        d = self.rotary_dim
        return 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float, device=device) / d))

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: int [T] or [3, T] -> (cos, sin), each [T, rotary_dim] in `dtype`."""
        inv = self.inv_freq(position_ids.device)
        if position_ids.dim() == 1:
            freqs = position_ids[:, None].float() * inv
        else:
            per_axis = position_ids[..., None].float() * inv  # [3, T, d/2]
            freqs = per_axis[0].clone()
            # Interleaved MRoPE: frequency i uses axis i % 3 within each axis' section.
            for axis in (1, 2):
                span = slice(axis, self.mrope_section[axis] * 3, 3)
                freqs[..., span] = per_axis[axis][..., span]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` features of each head. x: [T, H, Dh]; cos/sin: [T, R]."""
    r = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
