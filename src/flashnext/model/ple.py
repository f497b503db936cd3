"""Per-Layer Embedding (PLE): hashed n-gram features gated into every residual stream.

Legend: T tokens, hc streams, D hidden, E = ple_embed_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.cached import StepBatch
from flashnext.model.fused import project
from flashnext.model.ngram import NGramEmbedding
from flashnext.model.norm import RMSNorm
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

    def _gated(self, residual: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """n-gram values [T, E] gated into each stream by its agreement with the residual: -> [T, hc*D]."""
        key, value = project(emb, self.key_proj, self.value_proj)
        key = self.norm_key(key).unflatten(-1, (self.hc, self.hidden))
        query = self.norm_query(residual).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()  # signed square root
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        return gated

    def forward(self, residual: torch.Tensor, input_ids: torch.Tensor, seg: Segments) -> torch.Tensor:
        """residual: [T, hc*D]; input_ids: int [T] -> [T, hc*D]."""
        pos = seg.pos_in_seq
        emb = self.ple_embedding(input_ids, pos)  # [T, E]
        gated = self._gated(residual, emb)
        conv_in = self.norm_conv(gated)
        conv = causal_conv1d_varlen(conv_in, self.conv1d.weight.squeeze(1), pos, self.dilation)
        return gated + F.silu(conv).to(gated.dtype)

    def forward_cached(self, residual: torch.Tensor, input_ids: torch.Tensor, step: StepBatch, cache) -> torch.Tensor:
        """Serving: the n-gram context and the dilated conv continue from `cache` (a `PLECache`)."""
        ids_ext, pos_ext = step.with_history(input_ids.long(), step.gather(cache.ctx))
        real = step.extended(cache.ctx.shape[1])[1]
        rows = self.ple_embedding.hash_ids(ids_ext, pos_ext)[real]
        emb = self.ple_embedding.ngram_embedding(rows).flatten(-2)
        gated = self._gated(residual, emb)
        conv_in, conv_pos = step.with_history(self.norm_conv(gated), step.gather(cache.conv))
        conv = step.conv(conv_in, conv_pos, self.conv1d.weight.squeeze(1), cache.conv.shape[1], self.dilation)
        step.write_window(cache.ctx, ids_ext)
        step.write_window(cache.conv, conv_in)
        return gated + F.silu(conv).to(gated.dtype)
