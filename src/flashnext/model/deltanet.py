"""Gated DeltaNet linear attention on a flat stream: one forward for training and serving.

Serving passes `state` (its conv window and recurrent state); the ops take them in and return them out, and pick
their kernels by shape (chunked for prefill, the single-token recurrence for a decode step).

Legend: T tokens, N sequences, Hk key heads, Hv value heads, Dk/Dv head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.context import ContextShard
from flashnext.model.fused import Group, apply_linear
from flashnext.model.norm import GatedRMSNorm
from flashnext.model.state import RECURRENT, WINDOW, GDNState, StateSpec, StepState, step_of
from flashnext.ops.conv import causal_conv1d_varlen
from flashnext.ops.deltanet import gated_delta_rule, gated_delta_rule_affine


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
        self.in_proj = Group(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def state_spec(self, max_len: int) -> GDNState:
        """Per-sequence state: the conv's last K-1 input rows and the fp32 delta-rule state."""
        K = self.conv1d.kernel_size[0]
        return GDNState(
            conv=StateSpec((K - 1, self.conv1d.in_channels), kind=WINDOW),
            recurrent=StateSpec((self.hv, self.dk, self.dv), torch.float32, kind=RECURRENT),
        )

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

    def forward(
        self, x: torch.Tensor, seg: Segments, state: StepState[GDNState] | None = None, cp: ContextShard | None = None
    ) -> torch.Tensor:
        """x: [T, D] -> [T, D]. With `state` (serving), each entry continues its slot's conv window and recurrent
        state, and the live entries' new ones are written back. With `cp` (context parallelism), the sequence that
        enters this rank's slice continues the previous ranks' conv rows and recurrent state (`_context_rule`)."""
        fused = step_of(state).fused
        qkv, z, b, a = self.in_proj(x, fused)
        window = None if state is None else state.read(state.bufs.conv)
        if cp is not None:
            window = cp.left_halo(qkv, self.conv1d.kernel_size[0] - 1)
        conv_in = qkv
        qkv, window = causal_conv1d_varlen(qkv, seg, self.conv1d.weight.squeeze(1), initial_window=window)
        q, k, v, g, beta, z = self._heads(F.silu(qkv).to(x.dtype), z, b, a)
        if cp is not None:
            o = self._context_rule(q, k, v, g, beta, seg, cp)
        else:
            initial = None if state is None else state.read(state.bufs.recurrent)
            # On a slot run `initial` is a slice of the cache: the decode kernel writes the new state into it.
            in_place = state is not None and state.step.slot_run is not None
            if state is not None and state.keeps:  # a verify step: the state after every position, kept
                o, final, states = gated_delta_rule(q, k, v, g, beta, seg, initial_state=initial, positions=True)
                state.keep(state.bufs.recurrent, states)
                state.keep(state.bufs.conv, conv_in)
            else:
                o, final = gated_delta_rule(q, k, v, g, beta, seg, initial_state=initial, in_place=in_place)
        if state is not None:
            state.write(state.bufs.conv, window)
            state.write(state.bufs.recurrent, final)
        return apply_linear(self.out_proj, self.norm(o, z).flatten(-2), fused)

    def _context_rule(self, q, k, v, g, beta, seg: Segments, cp: ContextShard) -> torch.Tensor:
        """The delta rule on a context-parallel slice -> o [T, Hv, Dv].

        The slice's first sequence may continue from earlier ranks with a state S_in nobody knows yet. Its outputs
        are affine in S_in (`o0 + resp @ S_in`) and so is the state the slice hands on (`A @ S_in + U`), so every
        rank computes its pieces with one pass, the ranks exchange (A, U) and compose them (`incoming_state`), and
        the correction `resp @ S_in` is added: exact, with no rank waiting on another's scan.
        """
        o0, resp, A, U = gated_delta_rule_affine(q, k, v, g, beta, seg)
        s_in = cp.incoming_state(A, U)  # [Hv, Dk, Dv] fp32
        return o0 + torch.einsum("thk,hkv->thv", resp.float(), s_in).to(o0.dtype)
