"""Fixed-capacity per-slot state of every layer, allocated once: the serving model's memory.

Each buffer is `[max_slots + 1, ...]`: slots `0 .. max_slots-1` belong to requests, the last one is a scratch slot
that padding entries of a step read and write, so padding never touches a request's state. Buffers are never
reallocated or resized (shapes and storage addresses fixed for the cache's life, as a captured CUDA graph needs);
a step updates them in place with `index_copy_`.

Per layer (the model config decides which parts exist):
    GDN:  conv [S, K-1, conv_dim] (last pre-conv q/k/v rows), state fp32 [S, Hv, Dk, Dv] (recurrent state)
    PLE:  ctx int64 [S, ngram_size-1] (last token ids, EOS before the start), conv [S, (K-1)*ngram_size, hc*D]
    QSA:  k, v [S, Lc, Hkv, D] (rotated keys, values by position), raw_k [S, Lc, Di] (indexer keys),
          block_k [S, Lc/c, Di] (pooled, normalised, rotated block keys, written once when a block completes)
with S = max_slots + 1 and Lc = (max_model_len // c + 1) * c (a whole tail block past the last position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext.config import LINEAR, TextConfig
from flashnext.errors import InputError


@dataclass
class GDNCache:
    conv: torch.Tensor
    state: torch.Tensor

    @property
    def width(self) -> int:
        return self.conv.shape[1]


@dataclass
class PLECache:
    ctx: torch.Tensor
    conv: torch.Tensor


@dataclass
class QSACache:
    k: torch.Tensor
    v: torch.Tensor
    raw_k: torch.Tensor
    block_k: torch.Tensor


@dataclass
class LayerCache:
    gdn: GDNCache | None = None
    ple: PLECache | None = None
    qsa: QSACache | None = None

    def buffers(self) -> list[torch.Tensor]:
        out = []
        for part in (self.gdn, self.ple, self.qsa):
            if part is not None:
                out.extend(vars(part).values())
        return out


class StateCache:
    """Per-layer state buffers for `max_slots` sequences of up to `max_model_len` tokens, plus slot bookkeeping.

    Args:
        cfg: the model's text config.
        max_slots: concurrent sequences.
        max_model_len: longest sequence (prompt + generated tokens).
        dtype: dtype of activations kept (keys, values, conv windows); the GDN state is always fp32.
    """

    def __init__(self, cfg: TextConfig, max_slots: int, max_model_len: int, dtype=torch.float32, device="cpu"):
        if max_slots < 1 or max_model_len < 1:
            raise InputError(f"max_slots={max_slots} and max_model_len={max_model_len} must be >= 1")
        self.config = cfg
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.scratch_slot = max_slots
        self.eos_id = cfg.eos_id if cfg.eos_id is not None else 0
        S = max_slots + 1
        self.layers = [self._layer(cfg, i, S, dtype, device) for i in range(cfg.num_hidden_layers)]
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out the lowest slot first
        for slot in range(S):
            self.reset_slot(slot)

    def _layer(self, cfg: TextConfig, i: int, S: int, dtype, device) -> LayerCache:
        lc = LayerCache()
        if cfg.layer_types[i] == LINEAR:
            conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
            conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
            lc.gdn = GDNCache(
                conv=torch.zeros(S, cfg.linear_conv_kernel_dim - 1, conv_dim, dtype=dtype, device=device),
                state=torch.zeros(
                    S,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    dtype=torch.float32,
                    device=device,
                ),
            )
        else:
            c = cfg.indexer_compress_ratio
            nbs = self.max_model_len // c + 1
            kv = (S, nbs * c, cfg.num_key_value_heads, cfg.head_dim)
            lc.qsa = QSACache(
                k=torch.zeros(kv, dtype=dtype, device=device),
                v=torch.zeros(kv, dtype=dtype, device=device),
                raw_k=torch.zeros(S, nbs * c, cfg.indexer_head_dim, dtype=dtype, device=device),
                block_k=torch.zeros(S, nbs, cfg.indexer_head_dim, dtype=dtype, device=device),
            )
        if i + 1 in cfg.ple_layer_ids:
            width = cfg.hc_count * cfg.hidden_size
            lc.ple = PLECache(
                ctx=torch.zeros(S, cfg.ngram_size - 1, dtype=torch.long, device=device),
                conv=torch.zeros(S, (cfg.ple_conv_kernel_size - 1) * cfg.ngram_size, width, dtype=dtype, device=device),
            )
        return lc

    # ---- slots ---------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, its state reset to that of an empty sequence."""
        if not self._free:
            raise InputError(f"no free cache slot (max_slots={self.max_slots})")
        slot = self._free.pop()
        self.reset_slot(slot)
        return slot

    def release(self, slot: int) -> None:
        """Return `slot` to the free list and wipe its state (no trace of the previous sequence remains)."""
        if not 0 <= slot < self.max_slots or slot in self._free:
            raise InputError(f"slot {slot} is not allocated")
        self.reset_slot(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    @torch.no_grad()
    def reset_slot(self, slot: int) -> None:
        """Zero every buffer row of `slot`; the n-gram context reads as EOS (what precedes a sequence start)."""
        for lc in self.layers:
            for buf in lc.buffers():
                buf[slot].zero_()
            if lc.ple is not None:
                lc.ple.ctx[slot].fill_(self.eos_id)

    @torch.no_grad()
    def copy_slot(self, src: int, dst: int) -> None:
        """Make `dst`'s state a copy of `src`'s, in place (a fork: both continue the same sequence).

        Generic over `buffers()`: every per-slot buffer, whatever the layer kinds, is copied row for row, so `dst`
        then behaves exactly as `src` would (n choices of one prompt share its prefill this way).
        """
        if src == dst:
            return
        for buf in self.buffers():
            buf[dst].copy_(buf[src])

    def buffers(self) -> list[torch.Tensor]:
        """Every state tensor (for tests: compare states, check addresses never change)."""
        return [b for lc in self.layers for b in lc.buffers()]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
