"""Gated DeltaNet linear attention on a flat stream (chunked for prefill/training).

Legend: T tokens, Hk key heads, Hv value heads, Dk/Dv head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.cached import StepBatch
from flashnext.model.fused import linear, project
from flashnext.model.norm import GatedRMSNorm
from flashnext.ops.conv import causal_conv1d_varlen
from flashnext.ops.deltanet import chunk_gated_delta_rule
from flashnext.ops.deltanet_step import gated_delta_step


class GatedDeltaNet(nn.Module):
    """Conv-mixed q/k/v, delta-rule recurrence with learned decay, gated RMSNorm, output projection."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.hk * self.dk, self.hv * self.dv
        conv_dim = 2 * key_dim + value_dim
        D = cfg.hidden_size
        self.conv1d = nn.Conv1d(
            conv_dim,
            conv_dim,
            kernel_size=cfg.linear_conv_kernel_dim,
            groups=conv_dim,
            bias=False,
            padding=cfg.linear_conv_kernel_dim - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, activation=cfg.gate_act)
        self.out_proj = nn.Linear(value_dim, D, bias=False)
        self.in_proj_qkv = nn.Linear(D, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.hv, bias=False)
        self.in_proj_a = nn.Linear(D, self.hv, bias=False)

    def project(self, x: torch.Tensor, seg: Segments):
        """Everything before the recurrence: returns q, k [T, Hv, Dk], v [T, Hv, Dv], g, beta [T, Hv], z."""
        qkv, z, b, a = self._in_proj(x)
        qkv = causal_conv1d_varlen(qkv, self.conv1d.weight.squeeze(1), seg.pos_in_seq)
        return self._heads(F.silu(qkv).to(x.dtype), z, b, a)

    def _in_proj(self, x: torch.Tensor):
        """The four input projections of x [T, D]: pre-conv qkv, z, b, a (one fused matmul when serving)."""
        return project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _heads(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Split the conv-mixed `qkv` [T, conv_dim] into heads; gates from the projections z, b, a."""
        T = qkv.shape[0]
        kd = self.hk * self.dk
        q, k, v = torch.split(qkv, [kd, kd, self.hv * self.dv], dim=-1)
        q, k = q.view(T, self.hk, self.dk), k.view(T, self.hk, self.dk)
        v = v.view(T, self.hv, self.dv)
        if self.hv != self.hk:
            q = q.repeat_interleave(self.hv // self.hk, dim=1)
            k = k.repeat_interleave(self.hv // self.hk, dim=1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return q, k, v, g, beta, z.reshape(T, self.hv, self.dv)

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z: [T, Hv, Dv] -> [T, D]."""
        return linear(self.norm(o, z).flatten(-2), self.out_proj.weight, self.out_proj.bias)

    def forward(self, x: torch.Tensor, seg: Segments) -> torch.Tensor:
        q, k, v, g, beta, z = self.project(x, seg)
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, seg)
        return self.output(o, z)

    def forward_cached(self, x: torch.Tensor, step: StepBatch, cache) -> torch.Tensor:
        """Serving: continue each entry's conv window and recurrent state from `cache` (a `GDNCache`).

        Decode steps (one token per entry) take the batched single-token recurrence; prefill chunks the chunked
        rule with the cached state as initial state. Live entries' windows and states are written back.
        """
        qkv, z, b, a = self._in_proj(x)
        qkv_in, pos_ext = step.with_history(qkv, step.gather(cache.conv))
        qkv = step.conv(qkv_in, pos_ext, self.conv1d.weight.squeeze(1), cache.width)
        q, k, v, g, beta, z = self._heads(F.silu(qkv).to(x.dtype), z, b, a)
        state = step.gather(cache.state)
        if step.is_decode:  # with a slot run, the new state is written straight into the cache slice
            o, final = gated_delta_step(q, k, v, g, beta, state, in_place=step.slot_run is not None)
        else:
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, step.seg.cu_host, initial_state=state)
        step.write_window(cache.conv, qkv_in)
        step.store(cache.state, final)
        return self.output(o, z)
