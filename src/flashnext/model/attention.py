"""Gated full attention restricted by the QSA indexer (selected blocks + open tail), on a flat stream.

Legend: T tokens, H query heads, Hkv key/value heads, D head dim, Hi/Di indexer heads/dim, c compress ratio.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.cached import StepBatch
from flashnext.model.fused import linear, project
from flashnext.model.norm import RMSNorm
from flashnext.model.rope import apply_rotary
from flashnext.ops import qsa, qsa_cached


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

    @torch.no_grad()
    def forward_cached(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepBatch, cache):
        """Serving: store raw keys, pool blocks that complete in this step (once), select per query.

        Args:
            qk: [T, (Hi + 1) * Di], the `index_qk_proj` of the layer input (fused with the attention's own).

        Returns (blocks [T, kb], ok [T, kb]): block indices within each query's slot.
        """
        T = qk.shape[0]
        q = qk[:, : self.n_heads * self.head_dim].view(T, self.n_heads, self.head_dim)
        raw_k = qk[:, self.n_heads * self.head_dim :]
        q = apply_rotary(self.q_layernorm(q), cos, sin)
        flat = step.tok_slot * cache.raw_k.shape[1] + step.seg.position_ids
        cache.raw_k.view(-1, self.head_dim).index_copy_(0, flat, raw_k.to(cache.raw_k.dtype))
        blk_slot, blk_idx, blk_cos, blk_sin = step.new_blocks
        if blk_idx.numel():
            S, Lc, Di = cache.raw_k.shape
            pooled = cache.raw_k.view(S, Lc // self.ratio, self.ratio, Di)[blk_slot, blk_idx]
            keys = self.k_layernorm(pooled.float().mean(1).to(raw_k.dtype))
            keys = apply_rotary(keys.unsqueeze(1), blk_cos, blk_sin).squeeze(1)
            cache.block_k[blk_slot, blk_idx] = keys.to(cache.block_k.dtype)
        return qsa_cached.select_blocks_cached(
            q, cache.block_k, step.tok_slot, step.seg.position_ids, step.max_visible_blocks, self.ratio, self.block_topk
        )


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
        return self._heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def _heads(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections qg [T, H*Dh*2], k, v [T, Hkv*Dh] -> rotated, normed heads (as `project`)."""
        T = qg.shape[0]
        q, gate = qg.reshape(T, self.h, 2 * self.d).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(T, self.hkv, self.d)), cos, sin)
        return q, k, v.reshape(T, self.hkv, self.d), gate.reshape(T, self.h * self.d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments) -> torch.Tensor:
        sel, ok = self.indexer(x, cos, sin, seg)
        q, k, v, gate = self.project(x, cos, sin)
        o = qsa.sparse_attention(q, k, v, sel, ok, self.scale, seg, self.indexer.ratio)
        return self.o_proj(o.flatten(-2) * torch.sigmoid(gate))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepBatch, cache):
        """Serving: write this step's keys/values into `cache` (a `QSACache`), attend over the cached selection."""
        qg, k, v, qk = project(x, self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj)
        blocks, ok = self.indexer.forward_cached(qk, cos, sin, step, cache)
        q, k, v, gate = self._heads(qg, k, v, cos, sin)
        flat = step.tok_slot * cache.k.shape[1] + step.seg.position_ids
        cache.k.view(-1, self.hkv, self.d).index_copy_(0, flat, k.to(cache.k.dtype))
        cache.v.view(-1, self.hkv, self.d).index_copy_(0, flat, v.to(cache.v.dtype))
        o = qsa_cached.sparse_attention_cached(
            q, cache.k, cache.v, step.tok_slot, step.seg.position_ids, blocks, ok, self.scale, self.indexer.ratio
        )
        return linear(o.flatten(-2) * torch.sigmoid(gate), self.o_proj.weight, self.o_proj.bias)
