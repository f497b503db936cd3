"""The multi-token-prediction (MTP) draft head (`mtp.*`): one more decoder layer that predicts the token after next.

Cell i of a sequence pairs the trunk's pre-final-mixer residual `R_i` (all hc streams, `[hc*D]`) with the next
token `x_{i+1}`:
```
e = fc_embedding(norm_D(embed_tokens[x_{i+1}]))              [T, D]      norms are the model's (1 + w) RMSNorm
h = fc_hidden(norm_{hc*D}(R_i).view(T, hc, D))              [T, hc, D]  ONE norm over all hc*D values;
x = h + e[:, None, :]                                                    fc_hidden shared by the streams
x = layers[0](x)            QSA attention (own indexer), MoE, two hyper-connections; no PLE, no GDN
(R_next, y) = (x, hyper_connection_mixer(x))                 mixer without block_inject; no final norm
draft_logits = lm_head(y)                                    predicts x_{i+2}; the model's shared lm_head
```
(A checkpoint that stores `mtp.shared_head.head.weight` gives the head an LM head of its own: kept in the model's
`extra_tensors` and used instead of the shared one, `mtp_head_weight`.)
Cell i sits at RoPE position i and attends to the cells <= i of its sequence, so the head is a causal layer over
the sequence of cells:
- training runs it over the whole packed stream (`mtp_inputs`: the last cell of each sequence has no next token,
  gets a placeholder and no loss); the loss is cross-entropy against `x_{i+2}` within each sequence
  (`mtp_targets`);
- serving gives it its own QSA cache (positional state, one row per cell position, declared by `state_spec` like
  every layer's): the cell of each committed position is written once its next token is known (for the last fed
  position: the token just sampled), and draft step j > 0 feeds the previous step's `R_next` with its draft token
  at the next position. Rows a draft step writes past the committed length are rewritten before any query can see
  them (see `model.state`), so the head needs no rollback.

The causal LM registers the head after `lm_head`, so the trunk's `init_weights` draws do not depend on whether the
config declares a head.

Legend: T cells (tokens), D hidden, hc streams.
"""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments, next_token_targets
from flashnext.config import INDEXED, TextConfig
from flashnext.model.context import ContextShard
from flashnext.model.fused import apply_linear
from flashnext.model.hyper import GatedResidual
from flashnext.model.layer import DecoderLayer
from flashnext.model.norm import RMSNorm
from flashnext.model.state import StepState, step_of


class MultiTokenPredictor(nn.Module):
    """`mtp.*`: input norms and projections, `cfg.mtp_layers` attention decoder layers, the stream mixer."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        D, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.hc, self.hidden = hc, D
        self.pre_fc_norm_embedding = RMSNorm(D, eps=eps)
        self.pre_fc_norm_hidden = RMSNorm(hc * D, eps=eps)
        self.fc_embedding = nn.Linear(D, D, bias=False)
        self.fc_hidden = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, None, INDEXED) for _ in range(cfg.mtp_layers))
        self.hyper_connection_mixer = GatedResidual(D, hc, cfg.hc_lowrank, eps, inject=False)

    def state_spec(self, max_len: int) -> list[dict]:
        """Per MTP layer, its serving state (the QSA cache of cells, rows by position)."""
        return [layer.state_spec(max_len) for layer in self.layers]

    def forward(
        self,
        residual: torch.Tensor,
        next_embeds: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seg: Segments,
        state: StepState[list] | None = None,
        cp: ContextShard | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over a stream of cells.

        Args:
            residual: [T, hc*D] the trunk's pre-final-mixer residual `R_i` (or a previous draft step's `R_next`).
            next_embeds: [T, D] token embeddings of `x_{i+1}`.
            rope: (cos, sin) [T, R] at the cells' positions.
            seg: the cells' segments (one sequence of cells per sequence).
            state: serving: the step and the head's per-layer cache (`cache.layers` past the trunk's); the cells
                continue their slots' cached cells and the projections take the prepared fused path.
            cp: context parallelism (training): the cells are this rank's slice; the layer's QSA attention
                gathers the group's keys as the trunk's do (`model.context`).

        Returns:
            (R_next [T, hc*D], y [T, D]): the layer's multi-stream output and its mixed output (for `lm_head`).
        """
        step = step_of(state)
        fused = step.fused
        T = residual.shape[0]
        e = apply_linear(self.fc_embedding, self.pre_fc_norm_embedding(next_embeds), fused)
        normed = self.pre_fc_norm_hidden(residual).reshape(T * self.hc, self.hidden)
        h = apply_linear(self.fc_hidden, normed, fused).view(T, self.hc, self.hidden)
        x = (h + e.unsqueeze(1)).flatten(1)
        layer_state = None if state is None else StepState(state.step, state.bufs[0])
        x, _ = self.layers[0](x, None, rope, seg, None, layer_state, cp)
        return x, self.hyper_connection_mixer(x, step)


def mtp_inputs(input_ids: torch.Tensor, seg: Segments, placeholder: int = 0) -> torch.Tensor:
    """The next token `x_{i+1}` of every cell of a packed stream, int64 [T]; `placeholder` for each sequence's
    last cell (no next token: its output has no target, and being last it is visible to no other cell)."""
    return next_token_targets(input_ids, seg, placeholder)


def mtp_targets(labels: torch.Tensor, seg: Segments, ignore_index: int = -100) -> torch.Tensor:
    """Targets of the draft logits, int64 [T]: cell i predicts `labels[i + 2]` within its sequence, else
    `ignore_index` (the last two cells of each sequence)."""
    return next_token_targets(next_token_targets(labels, seg, ignore_index), seg, ignore_index)
