"""Sparse MoE: softmax top-k router, stacked expert weights with sort-based grouped dispatch, gated shared expert.

Legend: T tokens, D hidden, E experts, k experts per token, I expert width, A = T*k assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.config import TextConfig


class Router(nn.Module):
    """Softmax (fp32) over expert logits, top-k, optionally renormalised."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """x: [T, D] -> (weights [T, k] in x's dtype, experts int64 [T, k]).

        `replay` (int [T, k]) forces the experts (router replay); their softmax scores are gathered and
        renormalised as usual so gradients still reach the router.
        """
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if replay is None:
            top, experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            experts = replay.long()
            top = probs.gather(-1, experts)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top.to(logits.dtype), experts


class Experts(nn.Module):
    """E SwiGLU experts as 3-D weights: gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj [E, D, I]."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, D]; experts int64 [T, k]; weights [T, k] -> [T, D]."""
        T, k = experts.shape
        flat_e = experts.flatten()
        # Few assignments (decode), or the meta device (no routing values to size the slabs): gather path.
        if flat_e.numel() * 2 < self.num_experts or x.device.type == "meta":
            return self._gathered(x, flat_e, weights)
        return self._grouped(x, flat_e, weights)

    # Opaque to torch.compile: the slab's capacity is a data-dependent count (`int(counts.max())`).
    @torch.compiler.disable
    def _grouped(self, x, flat_e, weights):
        """Sort assignments by expert, lay each expert's tokens in a [E, cap, D] slab, one batched matmul each."""
        E = self.num_experts
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=E)
        cap = int(counts.max()) if flat_e.numel() else 0
        starts = torch.cumsum(counts, 0) - counts
        sorted_e = flat_e[order]
        slot = torch.arange(order.numel(), device=x.device) - starts[sorted_e]
        token = order // weights.shape[1]
        slab = x.new_zeros(E, cap, x.shape[1])
        slab[sorted_e, slot] = x[token]
        h = self._swiglu(slab, self.gate_up_proj, self.down_proj)  # [E, cap, D]
        out_sorted = h[sorted_e, slot] * weights.flatten()[order, None]
        return x.new_zeros(x.shape).index_add(0, token, out_sorted)

    def _gathered(self, x, flat_e, weights):
        """Few assignments (decode): gather each assignment's expert weights instead of touching all experts."""
        k = weights.shape[1]
        token = torch.arange(flat_e.numel(), device=x.device) // k
        h = self._swiglu(x[token].unsqueeze(1), self.gate_up_proj[flat_e], self.down_proj[flat_e]).squeeze(1)
        out = h * weights.flatten()[:, None]
        return x.new_zeros(x.shape).index_add(0, token, out)

    @staticmethod
    def _swiglu(x, gate_up, down):
        """x [G, n, D] with weights gate_up [G, 2I, D], down [G, D, I] -> [G, n, D]."""
        gate, up = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, down.transpose(1, 2))


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        """x: [T, D] -> ([T, D], experts int64 [T, k])."""
        weights, experts = self.gate(x, replay)
        out = self.experts(x, experts, weights)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out, experts
