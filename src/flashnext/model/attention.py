"""Gated full attention restricted by the QSA indexer (selected blocks + open tail), on a flat stream.

One forward for training and serving. Without state the keys and values come from the stream itself
(`ops.qsa`); with serving state (`QSAState`: rows by position) the step's keys, values and raw indexer keys are
written at their positions first, every block that completes in the step is pooled once, and each query attends
over its slot's selected blocks read from the cache (`ops.qsa_cached`). Both rank blocks with `ops.qsa.rank_blocks`
and pool them with `QSAIndexer.block_keys`, so training and serving select the same tokens.

Legend: T tokens, H query heads, Hkv key/value heads, D head dim, Hi/Di indexer heads/dim, c compress ratio,
NB blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.config import TextConfig
from flashnext.model.context import ContextShard
from flashnext.model.fused import Group, apply_linear, upcasts
from flashnext.model.norm import RMSNorm
from flashnext.model.rope import apply_rotary
from flashnext.model.state import POSITIONAL, QSAState, StateSpec, StepState, step_of
from flashnext.ops import qsa, qsa_cached


class QSAIndexer(nn.Module):
    """Scores mean-pooled key blocks per query and returns the tokens (or cached blocks) each query attends to.

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

    def block_keys(self, raw_blocks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Keys of complete blocks: pooled raw keys [NB, c, Di], normed, rotated at each block's first position
        (cos/sin [NB, R]) -> [NB, Di]."""
        keys = self.k_layernorm(qsa.pool_blocks(raw_blocks))
        return apply_rotary(keys.unsqueeze(1), cos, sin).squeeze(1)

    def _queries(self, x: torch.Tensor, cos, sin, qk: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated queries [T, Hi, Di] and raw keys [T, Di] (from `qk` when the caller computed it)."""
        qk = self.index_qk_proj(x) if qk is None else qk
        T = qk.shape[0]
        q = qk[:, : self.n_heads * self.head_dim].view(T, self.n_heads, self.head_dim)
        return apply_rotary(self.q_layernorm(q), cos, sin), qk[:, self.n_heads * self.head_dim :]

    @torch.compiler.disable  # block layout from host lengths: opaque to torch.compile (see flashnext.compile)
    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seg: Segments,
        state: StepState[QSAState] | None = None,
        qk: torch.Tensor | None = None,
        cp: ContextShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selection of every query of x [T, D].

        `qk`: `index_qk_proj(x)` [T, (Hi + 1) * Di] when the caller computed it already (the fused serving
        projection); else it is computed here, without gradient (the indexer is frozen).
        `cp` (context parallelism): the queries choose among every rank's blocks (`cp.gather_blocks`); no block
        straddles two ranks (the layout's padding), so each rank pools exactly its own complete blocks.

        Returns:
            Without state: (sel [T, n], ok [T, n]) flat token indices of the stream to attend (with `cp`: of the
            whole stream `cp.global_seg`).
            With state: `select_cached`'s (blocks [T, kb], ok [T, kb]).
        """
        if state is not None:
            return self.select_cached(x, cos, sin, seg, state, qk)
        q, raw_k = self._queries(x, cos, sin, qk)
        starts = qsa.complete_blocks(seg, self.ratio)
        keys = self.block_keys(raw_k[qsa.block_rows(starts, self.ratio)], cos[starts], sin[starts])
        if cp is None:
            return qsa.select_tokens(q, keys, starts, seg, self.ratio, self.block_topk)
        keys, starts = cp.gather_blocks(keys), qsa.complete_blocks(cp.global_seg, self.ratio)
        return qsa.select_tokens(q, keys, starts, cp.global_seg, self.ratio, self.block_topk, q_offset=cp.offset)

    @torch.no_grad()
    def select_cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seg: Segments,
        state: StepState[QSAState],
        qk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Serving: store the step's raw keys, pool the blocks it completes into the cache, select per query.

        Traceable (no host layout: the step's blocks were planned by `plan_blocks`), so a compiled decode step
        includes it.

        Returns:
            (blocks [T, kb], ok [T, kb]) block indices within each query's slot.
        """
        q, raw_k = self._queries(x, cos, sin, qk)
        step, cache = state.step, state.bufs
        S, Lc, Di = cache.raw_k.shape
        flat = step.tok_slot * Lc + seg.position_ids
        cache.raw_k.view(-1, Di).index_copy_(0, flat, raw_k.to(cache.raw_k.dtype))
        plan = step.blocks
        if plan.block.numel():
            raw_blocks = cache.raw_k.view(S, Lc // self.ratio, self.ratio, Di)[plan.slot, plan.block]
            keys = self.block_keys(raw_blocks.to(raw_k.dtype), plan.cos, plan.sin).to(cache.block_k.dtype)
            if plan.done is not None:  # static step: one candidate per entry, rewritten unless it completed
                keys = torch.where(plan.done[:, None], keys, cache.block_k[plan.slot, plan.block])
            cache.block_k[plan.slot, plan.block] = keys
        most = cache.block_k.shape[1] if step.static else plan.most
        one = step.slot_run[0] if step.slot_run is not None and step.slot_run[1] == 1 else None  # one sequence
        return qsa_cached.select_blocks_cached(
            q, cache.block_k, step.tok_slot, seg.position_ids, most, self.ratio, self.block_topk, one
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
        self.in_proj = Group(self.q_proj, self.k_proj, self.v_proj, self.indexer.index_qk_proj)

    def state_spec(self, max_len: int) -> QSAState:
        """Per-sequence state, rows by position, for sequences of up to `max_len` tokens."""
        c, Di = self.indexer.ratio, self.indexer.head_dim
        rows = (max_len // c + 1) * c
        return QSAState(
            k=StateSpec((rows, self.hkv, self.d), kind=POSITIONAL),
            v=StateSpec((rows, self.hkv, self.d), kind=POSITIONAL),
            raw_k=StateSpec((rows, Di), kind=POSITIONAL),
            block_k=StateSpec((rows // c, Di), kind=POSITIONAL),
        )

    def _heads(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections qg [T, H*Dh*2], k, v [T, Hkv*Dh] -> rotated, normed q [T, H, Dh], k, v [T, Hkv, Dh] and
        the output gate [T, H*Dh]."""
        T = qg.shape[0]
        q, gate = qg.reshape(T, self.h, 2 * self.d).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(T, self.hkv, self.d)), cos, sin)
        return q, k, v.reshape(T, self.hkv, self.d), gate.reshape(T, self.h * self.d)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seg: Segments,
        state: StepState[QSAState] | None = None,
        cp: ContextShard | None = None,
    ) -> torch.Tensor:
        """x: [T, D] -> [T, D], rotated by `rope` (cos, sin). With `state` (serving), queries attend over their
        slots' cached keys/values; with `cp` (context parallelism), over every rank's keys/values (`cp.gather`,
        gradient back to their owners)."""
        cos, sin = rope
        fused = step_of(state).fused
        if fused:  # the indexer's projection joins the fused GEMM
            qg, k, v, qk = self.in_proj(x, fused=True)
        else:
            qg, k, v, qk = self.q_proj(x), self.k_proj(x), self.v_proj(x), None
        q, k, v, gate = self._heads(qg, k, v, cos, sin)
        c = self.indexer.ratio
        if state is None:
            sel, ok = self.indexer(x, cos, sin, seg, cp=cp)
            if cp is not None:  # one exchange for both; `sel` indexes the whole stream
                k, v = cp.gather(torch.cat([k, v], dim=-1)).split(self.d, dim=-1)
                seg = cp.global_seg
            o = qsa.sparse_attention(q, k, v, sel, ok, self.scale, seg, c)
        else:
            blocks, ok = self.indexer.select_cached(x, cos, sin, seg, state, qk=qk)
            cache, tok_slot, rows = state.bufs, state.step.tok_slot, seg.position_ids
            flat = tok_slot * cache.k.shape[1] + rows
            cache.k.view(-1, self.hkv, self.d).index_copy_(0, flat, k.to(cache.k.dtype))
            cache.v.view(-1, self.hkv, self.d).index_copy_(0, flat, v.to(cache.v.dtype))
            o = qsa_cached.sparse_attention_cached(
                q, cache.k, cache.v, tok_slot, rows, blocks, ok, self.scale, c, fp32_products=fused and upcasts(q)
            )
        return apply_linear(self.o_proj, o.flatten(-2) * torch.sigmoid(gate), fused)
