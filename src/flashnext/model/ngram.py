"""Hashed n-gram ids and the n-gram embedding table of a PLE layer.

For token t, its k-gram (k = 2..ngram_size) is hashed as `XOR_j (tok[t-j] * m_j)` in wrapping int64, then each of
`heads_per_ngram` heads takes it modulo its own prime table size and adds the head's row offset. Context before a
sequence start or before the token after an EOS reads as EOS. Head table sizes are successive primes counted
globally across PLE layers; the table is padded to a multiple of `make_ngram_vocab_size_divisible_by`.

The table lookup is the module `ngram_embedding` (an `nn.Embedding` called on flat ids) so it can be swapped from
outside the model: for a frozen table in another storage (`flashnext.ngram.NgramTable`, chosen at load) or an
owner-routed, row-sharded embedding (`parallel/`).

Across serving steps the context is carried as state: the last `ngram_size - 1` ids of each sequence (EOS for a
fresh one, which is what precedes a sequence start), passed in as `initial_context` and returned updated.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments, last_rows, prepend_history
from flashnext.config import TextConfig
from flashnext.model.fused import reduced
from flashnext.ngram_hash import hash_constants


def context_tokens(ids: torch.Tensor, pos_in_seq: torch.Tensor, eos_id: int, shift: int) -> torch.Tensor:
    """`ids[t - shift]` where it lies in t's sequence and after t's last preceding EOS, else `eos_id`.

    ids, pos_in_seq: int64 [T].
    """
    if shift == 0:
        return ids
    T = ids.shape[0]
    t = torch.arange(T, device=ids.device)
    eos_at = torch.where(ids == eos_id, t, -1)
    last_eos = torch.cummax(eos_at, 0).values
    prev_eos = torch.cat([last_eos.new_full((1,), -1), last_eos[:-1]])
    segment_start = torch.maximum(t - pos_in_seq, prev_eos + 1)
    valid = t - shift >= segment_start
    shifted = ids[(t - shift).clamp_min(0)]
    return torch.where(valid, shifted, torch.full_like(ids, eos_id))


class NGramEmbedding(nn.Module):
    """Hashes token contexts to n-gram rows and looks them up: ids [T] -> [T, ple_embed_dim]."""

    def __init__(self, cfg: TextConfig, ple_index: int):
        super().__init__()
        self.ngram_size = cfg.ngram_size
        self.heads_per_ngram = cfg.heads_per_ngram
        self.num_heads = cfg.ngram_heads
        self.eos_id = cfg.eos_id
        self.ple_index = ple_index
        self._mults, self._sizes, self._offsets = hash_constants(cfg, ple_index)
        div = cfg.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(self._sizes) / div) * div
        self.register_buffer("layer_multipliers", torch.zeros(self.ngram_size, dtype=torch.long), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.zeros(self.num_heads, dtype=torch.long), persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.zeros(self.num_heads, dtype=torch.long), persistent=False)
        self.reset_buffers()
        self.ngram_embedding = nn.Embedding(rows, cfg.ple_embed_dim // self.num_heads)

    def reset_buffers(self) -> None:
        """Recompute the hash constants (after `to_empty` from the meta device)."""
        dev = self.layer_multipliers.device
        if dev.type == "meta":
            return
        self.layer_multipliers.copy_(torch.tensor(self._mults, dtype=torch.long))
        self.ngram_heads_vocab_sizes.copy_(torch.tensor(self._sizes, dtype=torch.long))
        self.ngram_heads_offsets.copy_(torch.tensor(self._offsets, dtype=torch.long))

    def hash_ids(
        self, ids: torch.Tensor, seg: Segments, initial_context: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Table rows of every token, and the context that follows each sequence.

        Args:
            ids: int [T] token ids of the stream.
            seg: the stream's segments.
            initial_context: optional int64 [N, ngram_size - 1], the ids before each sequence (EOS-filled for a
                fresh one); None reads EOS before every sequence start.

        Returns:
            rows int64 [T, num_heads] and, with an initial context, the final context [N, ngram_size - 1].
        """
        ids = ids.long()
        if initial_context is None:
            return self._rows(ids, seg.pos_in_seq), None
        ids_ext, layout = prepend_history(ids, initial_context, seg)
        rows = self._rows(ids_ext, layout.pos)[layout.real]
        return rows, last_rows(ids_ext, layout, seg)

    def _rows(self, ids: torch.Tensor, pos_in_seq: torch.Tensor) -> torch.Tensor:
        """int64 [T] token ids with their offsets from the sequence start -> int64 [T, num_heads] table rows."""
        ctx = [context_tokens(ids, pos_in_seq, self.eos_id, j) for j in range(self.ngram_size)]
        mixed = ctx[0] * self.layer_multipliers[0]
        per_order = []
        for order in range(2, self.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, ctx[order - 1] * self.layer_multipliers[order - 1])
            heads = slice((order - 2) * self.heads_per_ngram, (order - 1) * self.heads_per_ngram)
            sizes = self.ngram_heads_vocab_sizes[heads]
            per_order.append(torch.remainder(mixed[:, None], sizes) + self.ngram_heads_offsets[heads])
        return torch.cat(per_order, dim=-1)

    def forward(
        self, ids: torch.Tensor, seg: Segments, initial_context: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids int [T] -> (embeddings [T, ple_embed_dim], final context or None; see `hash_ids`)."""
        rows, context = self.hash_ids(ids, seg, initial_context)
        return self._lookup(rows).flatten(-2), context

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """The table rows [T, heads, E / heads]. Where the PLE's key/value product of these rows will run as
        `fused.reduced_linear` on a 16-bit table (inside a compiled inference graph: one row on a CPU without the
        dtype's instructions), a plain table is read through `embedding_bag` (one row per bag, summed: the row
        itself), a kernel of its own: inductor inlined `embedding`'s gather into that product's loop, gathering the
        rows again for each of its 768 outputs through 16-lane index vectors spilled to the stack. Bench config,
        bf16 batch-1 decode graph, 2 threads, AVX2: 2.22-2.27 -> 1.88-1.91 ms. Not elsewhere: at fp32 batch 1 and bf16
        batch 4 the extra kernel measured slower (2.12-2.18 against 2.21-2.26 ms; 5.36 against 5.63 ms)."""
        table = self.ngram_embedding
        w = table.weight if type(table) is nn.Embedding else None
        if w is None or w.element_size() != 2 or torch.is_grad_enabled() or not reduced(len(rows), w.dtype, w.device):
            return table(rows)
        flat = rows.reshape(-1)
        bags = torch.arange(flat.numel(), device=flat.device)
        return F.embedding_bag(flat, w, bags, mode="sum").unflatten(0, rows.shape)
