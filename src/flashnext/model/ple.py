"""Per-Layer Embedding (PLE): hashed n-gram features gated into every residual stream.

One forward for training and serving: with serving state (`PLEState`) the n-gram context and the dilated conv's
window continue each slot's sequence and are written back.

Legend: T tokens, hc streams, D hidden, E = ple_embed_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.context import ContextShard
from flashnext.model.fused import Group
from flashnext.model.ngram import NGramEmbedding
from flashnext.model.norm import RMSNorm
from flashnext.model.state import WINDOW, PLEState, StateSpec, StepState, step_of
from flashnext.ops.conv import causal_conv1d_varlen


class PLELayer(nn.Module):
    """Adds `[T, hc*D]` to the residual: stream-gated n-gram values plus a dilated depthwise conv of them.

    The conv has dilation `ngram_size`, so its causal window is `(kernel - 1) * ngram_size` tokens.
    """

    def __init__(self, cfg: TextConfig, ple_index: int):
        super().__init__()
        D, hc, E = cfg.hidden_size, cfg.hc_count, cfg.ple_embed_dim
        self.hidden, self.hc = D, hc
        self.dilation = cfg.ngram_size
        self.ple_embedding = NGramEmbedding(cfg, ple_index)
        self.key_proj = nn.Linear(E, hc * D, bias=False)
        self.value_proj = nn.Linear(E, D, bias=False)
        self.norm_key = RMSNorm(hc * D, group_size=D, eps=cfg.rms_norm_eps)
        self.norm_query = RMSNorm(hc * D, group_size=D, eps=cfg.rms_norm_eps)
        self.norm_conv = RMSNorm(hc * D, group_size=D, eps=cfg.rms_norm_eps)
        self.conv1d = nn.Conv1d(
            hc * D, hc * D, kernel_size=cfg.ple_conv_kernel_size, groups=hc * D, dilation=self.dilation, bias=False
        )
        self.key_value = Group(self.key_proj, self.value_proj)

    def state_spec(self, max_len: int) -> PLEState:
        """Per-sequence state: the last `ngram_size - 1` ids (EOS for a fresh sequence) and the dilated conv's
        last `(kernel - 1) * ngram_size` input rows."""
        K, width = self.conv1d.kernel_size[0], self.conv1d.in_channels
        emb = self.ple_embedding
        eos = emb.eos_id if emb.eos_id is not None else 0
        return PLEState(
            context=StateSpec((emb.ngram_size - 1,), torch.int64, fill=eos, kind=WINDOW),
            conv=StateSpec(((K - 1) * self.dilation, width), kind=WINDOW),
        )

    def _gated(self, residual: torch.Tensor, emb: torch.Tensor, fused: bool) -> torch.Tensor:
        """n-gram values [T, E] gated into each stream by its agreement with the residual: -> [T, hc*D]."""
        key, value = self.key_value(emb, fused)
        key = self.norm_key(key).unflatten(-1, (self.hc, self.hidden))
        query = self.norm_query(residual).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
        return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)

    def forward(
        self,
        residual: torch.Tensor,
        input_ids: torch.Tensor,
        seg: Segments,
        state: StepState[PLEState] | None = None,
        cp: ContextShard | None = None,
    ) -> torch.Tensor:
        """residual: [T, hc*D]; input_ids: int [T] -> [T, hc*D].

        `state` (serving) continues each entry's slot; `cp` (context parallelism) continues the sequence that
        enters this rank's slice: the n-gram context and the conv window are the rows before it (`left_halo`).
        """
        emb_mod = self.ple_embedding
        context = None if state is None else state.read(state.bufs.context)
        if cp is not None:
            eos = emb_mod.eos_id if emb_mod.eos_id is not None else 0
            context = cp.left_halo(input_ids.long(), emb_mod.ngram_size - 1, fill=eos)
        emb, context = emb_mod(input_ids, seg, initial_context=context)  # [T, E]
        gated = self._gated(residual, emb, fused=step_of(state).fused)
        conv_in = self.norm_conv(gated)
        window = None if state is None else state.read(state.bufs.conv)
        if cp is not None:
            window = cp.left_halo(conv_in, (self.conv1d.kernel_size[0] - 1) * self.dilation)
        weight = self.conv1d.weight.squeeze(1)
        conv, window = causal_conv1d_varlen(conv_in, seg, weight, self.dilation, initial_window=window)
        if state is not None:
            if state.keeps:  # a verify step: the rows the windows slide over, kept
                state.keep(state.bufs.context, input_ids.long())
                state.keep(state.bufs.conv, conv_in)
            state.write(state.bufs.context, context)
            state.write(state.bufs.conv, window)
        return gated + F.silu(conv).to(gated.dtype)
