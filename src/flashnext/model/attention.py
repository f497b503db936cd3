"""Gated full attention restricted by the QSA indexer (selected blocks + open tail), on a flat stream.

Legend: T tokens, H query heads, Hkv key/value heads, D head dim, Hi/Di indexer heads/dim, c compress ratio.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.norm import RMSNorm
from flashnext.model.rope import apply_rotary
from flashnext.ops import qsa


class QSAIndexer(nn.Module):
    """Scores mean-pooled key blocks per query and returns the tokens each query attends to.

    The selection is a discrete choice, so no gradient flows into the indexer (it is frozen in training).
    """

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.n_heads = cfg.indexer_n_heads
        self.head_dim = cfg.indexer_head_dim
        self.ratio = cfg.indexer_compress_ratio
        self.block_topk = cfg.indexer_budget // cfg.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * self.head_dim, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    @torch.compiler.disable  # block layout from host lengths: opaque to torch.compile (see train/compile.py)
    @torch.no_grad()
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments):
        """x: [T, D_model] -> (sel [T, n], ok [T, n]) flat token indices to attend."""
        T = x.shape[0]
        qk = self.index_qk_proj(x)
        q = qk[:, : self.n_heads * self.head_dim].view(T, self.n_heads, self.head_dim)
        raw_k = qk[:, self.n_heads * self.head_dim :]
        q = apply_rotary(self.q_layernorm(q), cos, sin)
        starts = qsa.complete_blocks(seg, self.ratio)
        keys = self.k_layernorm(qsa.pool_block_keys(raw_k, starts, self.ratio))
        keys = apply_rotary(keys.unsqueeze(1), cos[starts], sin[starts]).squeeze(1)
        return qsa.select_tokens(q, keys, starts, seg, self.ratio, self.block_topk)


class Attention(nn.Module):
    """Output-gated GQA with per-head q/k RMSNorm and partial RoPE, over QSA-selected tokens."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.scale = self.d**-0.5
        self.q_proj = nn.Linear(D, self.h * self.d * 2, bias=bias)
        self.k_proj = nn.Linear(D, self.hkv * self.d, bias=bias)
        self.v_proj = nn.Linear(D, self.hkv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.h * self.d, D, bias=bias)
        self.q_norm = RMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.indexer = QSAIndexer(cfg)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [T, D] -> rotated q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], gate [T, H*Dh]."""
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.h, 2 * self.d).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(T, self.hkv, self.d)), cos, sin)
        v = self.v_proj(x).view(T, self.hkv, self.d)
        return q, k, v, gate.reshape(T, self.h * self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments) -> torch.Tensor:
        sel, ok = self.indexer(x, cos, sin, seg)
        q, k, v, gate = self.project(x, cos, sin)
        o = qsa.sparse_attention(q, k, v, sel, ok, self.scale, seg, self.indexer.ratio)
        return self.o_proj(o.flatten(-2) * torch.sigmoid(gate))
