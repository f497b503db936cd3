"""What a context-parallel rank's forward asks of its group: the model's side of `flashnext.parallel.context`.

Under context parallelism (CP) each rank of a CP group runs the model on one contiguous slice of a packed stream
(`flashnext.parallel.context` plans the slices and implements this protocol with collectives; the model never
imports the distributed package). Every per-token part of a layer (norms, projections, MoE, hyper-connections) is local.
Three mixers read across the slice's left edge, and each asks the `cp` object it is given for exactly what it
needs, in the form the ops already take for serving state:

- PLE (n-gram hash, dilated conv) and the GDN short conv: `left_halo(x, width, fill)` is each local sequence's
  `initial_context` / `initial_window`: the `width` rows before the slice for the sequence that continues into it
  (`fill` before that sequence's start), `fill` for every other local sequence;
- the GDN recurrence: every rank gives the affine pair of its last sequence (its final state is `A @ S_in + U`
  for the state S_in entering its first sequence, `ops.deltanet.gated_delta_rule_affine`) and
  `incoming_state(A, U)` returns this rank's S_in, composed from the pairs of the ranks before it;
- QSA: `gather(x)` concatenates every rank's rows (keys and values, with gradient) and `gather_blocks(keys)` every
  rank's complete-block keys (no gradient: the indexer is frozen); both describe the whole stream `global_seg`, of
  which this rank's tokens are rows `offset .. offset + T - 1`.

The heads read across the right edge: `next_rows(x)` shifts labels to next-token targets (twice for the MTP head)
and gives the MTP head each cell's next token, as one process shifts them within a sequence.

The calls are collectives: every rank of the group makes them in the same order, which the identical layer code on
every rank ensures, and each result depends on the exchanged tensors on every rank (also where it is all fill), so
every rank also joins each exchange's backward.

Legend: T local tokens, N local sequences, C channels, H heads, K/V delta-rule key/value dims.
"""

from __future__ import annotations

from typing import Protocol

import torch

from flashnext.batch import Segments


class ContextShard(Protocol):
    """One rank's view of a context-parallel group (see the module doc).

    Attributes:
        offset: the stream row of this rank's first token.
        global_seg: segments of the whole (padded) stream of the group, identical on every rank.
    """

    offset: int
    global_seg: Segments

    def left_halo(self, x: torch.Tensor, width: int, fill: int | float = 0) -> torch.Tensor:
        """x [T, *C] -> [N, width, *C]: the rows before each local sequence (autograd flows to the owners)."""
        ...

    def incoming_state(self, A: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
        """This rank's last-sequence affine pair A [H, K, K], U [H, K, V] -> the state [H, K, V] entering its first
        sequence (zeros when that sequence starts on this rank)."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, *C] -> [T_global, *C], every rank's rows in stream order (gradient returns to each owner)."""
        ...

    def gather_blocks(self, keys: torch.Tensor) -> torch.Tensor:
        """This rank's complete-block keys [NB, Di] -> every rank's [NB_global, Di] in stream order (no gradient)."""
        ...

    def next_rows(self, x: torch.Tensor, fill: int | float = -100) -> torch.Tensor:
        """x [T] (ids or labels, no gradient) -> [T]: each row's next row within its sequence, across the right
        edge (`fill` at each sequence's last row)."""
        ...
