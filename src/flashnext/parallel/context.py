"""Context parallelism (CP): one packed stream split across the ranks of a CP group, with the same results.

Applied from outside the model, like FSDP: the caller plans the layout, hands each rank its slice and a
`DistributedShard` (the `flashnext.model.context.ContextShard` of that rank), and the model's mixers ask the shard
for what crosses the slice's left edge. Nothing here changes the model's math; every exchange is a collective of
the CP group with an autograd-aware backward.

Layout (`plan_layout`). Rank r of a group of P owns rows `[r L, (r + 1) L)` of the padded stream, L a multiple of
c = `indexer_compress_ratio` (1 without QSA). A QSA block is c tokens counted from its sequence's start, so a
rank boundary (a multiple of c) cuts no block exactly when every sequence that crosses a boundary starts at a
multiple of c: before such a sequence that does not, an inert padding segment of `(-start) % c` tokens is
inserted; the stream is then padded at the end to P L (cut at rank boundaries). Padding rows form their own
segments (every mixer resets at a segment start, so they touch no real token) and carry no target; sequences that
do not cross a boundary (and all of their positions) are left as they are. Sequences end anywhere inside a rank.

Exchanges (`DistributedShard`), one per mixer that reads across the edge:
- `left_halo(x, W)`: every rank's last min(W, L) rows are all-gathered; a rank takes the W rows before its first
  row (masked to `fill` before the start of the sequence that continues into it; `fill` on rank 0 and when its
  first sequence starts on it). The PLE n-gram context (ids, no gradient), PLE dilated-conv window and GDN
  short-conv window use it. Backward: the gathered rows' gradients are reduce-scattered to their owners.
- `incoming_state(A, U)`: the GDN recurrence by affine pairs. Each rank computes its slice from a zero state plus
  the response to its first sequence's unknown incoming state (`ops.deltanet.gated_delta_rule_affine`), so it can
  hand on its last sequence's final state as `A @ S_in + U`. The (A, U) of every rank are all-gathered and every
  rank composes the whole chain `S_{j+1} = carry_{j+1} * (A_j S_j + U_j)` (P small matmuls), keeping its own S_r.
  Chosen over passing the state rank to rank because it is one collective that every rank joins in the same
  order, forward and backward, so it composes with the other collectives, FSDP and activation-checkpoint recompute
  without point-to-point ordering hazards, and no rank waits for the previous rank's scan (a P-step chain).
  Its cost is K extra value channels in the delta rule of each slice.
- `gather(x)`: QSA keys and values of every rank (all-gather; backward reduce-scatter) and `gather_blocks`: the
  complete-block indexer keys (all-gather of each rank's keys padded to L / c rows, no gradient).
- `next_rows(x)`: the one exchange across the right edge, for the heads' targets (no gradient): labels shifted to
  next-token targets (and twice for the MTP head's), and the MTP head's next-token inputs, formed on the gathered
  stream exactly as one process forms them.

Why the mixers ask a shard (`cp=` passed down the forward, like serving state) rather than `parallelize` installing
module hooks or wrappers: the exchanged quantities (the convs' input rows, the GDN (A, U) pair, K/V after RoPE) are
intermediate values inside the mixers, so hooks would have to split each mixer into hookable pieces or re-run part
of it, and the per-batch layout would still have to reach them. The halos come in the form the ops already take as
serving state (`initial_window`, `initial_context`, `initial_state`), so the model math reads the same as serving's.

Groups: `context_group(rank, world, cp)` splits the world into `world / cp` groups of `cp` consecutive ranks (a
group trains one micro-batch; FSDP shards over the whole world, so its reduce-scatter sums every rank's gradient).

Legend: T tokens of the input stream, R = P L padded rows, L rows per rank, P ranks per group, c block size,
W halo rows, H/K/V delta-rule heads/key/value dims.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flashnext.batch import PackedBatch, Segments, make_segments, next_token_targets
from flashnext.errors import ConfigError, InputError

__all__ = [
    "ContextBatch",
    "ContextGroup",
    "ContextLayout",
    "DistributedShard",
    "context_group",
    "plan_layout",
]

IGNORE_INDEX = -100


@dataclass
class ContextLayout:
    """Where every token of a packed stream lies in the padded stream that P ranks split (see the module doc).

    Attributes:
        cp: P, ranks in the group.
        ratio: c, the QSA block size the rank boundaries respect (1 without QSA).
        local_len: L, rows per rank (a multiple of c).
        cu_seqlens: host list [S + 1] of the padded stream's segment boundaries (input sequences and padding).
        token_rows: int64 [T], the padded row of every input token (increasing).
        pad_segments: indices (into the segments) of the padding segments.
    """

    cp: int
    ratio: int
    local_len: int
    cu_seqlens: list[int]
    token_rows: torch.Tensor
    pad_segments: list[int]
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        """R = P L."""
        return self.cp * self.local_len

    def pad(self, x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """x [T, ...] of the input stream -> [R, ...] with `fill` on padding rows."""
        out = x.new_full((self.num_rows, *x.shape[1:]), fill)
        out[self.token_rows.to(x.device)] = x
        return out

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y [R, ...] of the padded stream -> [T, ...] at the input tokens."""
        return y.index_select(0, self.token_rows.to(y.device))

    def rows(self, rank: int) -> tuple[int, int]:
        """The padded rows `[lo, hi)` rank `rank` owns."""
        return rank * self.local_len, (rank + 1) * self.local_len

    def local_cu(self, rank: int) -> list[int]:
        """Host boundaries of rank's slice: its pieces of the segments it overlaps (no zero-length pieces)."""
        lo, hi = self.rows(rank)
        cu = self.cu_seqlens
        inner = sorted({b - lo for b in cu[bisect.bisect_right(cu, lo) : bisect.bisect_left(cu, hi)]})
        return [0, *inner, self.local_len]

    def first_start(self, rank: int) -> int:
        """Padded row where the segment holding rank's first row starts (< lo: it continues from earlier ranks)."""
        lo = self.rows(rank)[0]
        return self.cu_seqlens[bisect.bisect_right(self.cu_seqlens, lo) - 1]

    def carries_in(self, rank: int) -> bool:
        """Rank's first segment started on an earlier rank."""
        return self.first_start(rank) < self.rows(rank)[0]

    def block_counts(self) -> list[int]:
        """Complete QSA blocks each rank pools (its pieces' `length // c`; they tile the whole stream's blocks)."""
        counts = []
        for r in range(self.cp):
            cu = self.local_cu(r)
            counts.append(sum((b - a) // self.ratio for a, b in zip(cu[:-1], cu[1:], strict=True)))
        return counts

    def global_segments(self, device: torch.device | str = "cpu") -> Segments:
        """The padded stream's `Segments` (memoised per device; identical on every rank)."""
        key = str(device)
        if key not in self._memo:
            cu = torch.tensor(self.cu_seqlens, dtype=torch.int32)
            self._memo[key] = make_segments(cu, self.num_rows, device=device)
        return self._memo[key]

    def targets(self, labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Next-token targets formed on the input stream (they cross rank edges), then padded: int64 [R]."""
        seg = make_segments(cu_seqlens, labels.shape[0], device=labels.device)
        return self.pad(next_token_targets(labels, seg, IGNORE_INDEX), IGNORE_INDEX)


def plan_layout(lengths: list[int], cp: int, ratio: int = 1) -> ContextLayout:
    """Plan the padded stream that P = `cp` ranks split (see the module doc).

    Args:
        lengths: host list of the N sequence lengths of the packed stream (zero-length sequences allowed).
        cp: ranks in the group; ratio: the QSA block size c (1 without QSA).

    Returns:
        The `ContextLayout`; L is the smallest multiple of c that holds the stream and its alignment padding.
    """
    if cp < 1 or ratio < 1:
        raise ConfigError(f"context parallelism needs cp >= 1 and ratio >= 1, got cp={cp}, ratio={ratio}")
    L = max(ratio, -(-sum(lengths) // (cp * ratio)) * ratio)
    while (starts := _place(lengths, L, ratio))[-1] > cp * L:
        L += ratio  # the alignment padding pushed the stream past the last rank
    return _build(lengths, starts[:-1], cp, ratio, L)


def _place(lengths: list[int], L: int, ratio: int) -> list[int]:
    """Padded start row of every sequence (and, last, the end of the stream) for slices of L rows: a sequence
    that crosses a slice boundary from a start that is not a multiple of c is moved to the next multiple."""
    starts, row = [], 0
    for n in lengths:
        if n > 0 and row % ratio and row // L != (row + n - 1) // L:
            row += -row % ratio  # realigned it may no longer cross; either way no block straddles a boundary
        starts.append(row)
        row += n
    return [*starts, row]


def _build(lengths: list[int], starts: list[int], cp: int, ratio: int, L: int) -> ContextLayout:
    """The layout of sequences placed at `starts`: padding segments fill the gaps and the tail (cut at slices)."""
    cu, pads, row = [0], [], 0
    token_rows = []

    def pad_to(end: int) -> None:
        nonlocal row
        while row < end:  # padding never straddles a slice boundary
            stop = min(end, (row // L + 1) * L)
            pads.append(len(cu) - 1)
            cu.append(stop)
            row = stop

    for start, n in zip(starts, lengths, strict=True):
        pad_to(start)
        token_rows.append(torch.arange(start, start + n))
        row = start + n
        cu.append(row)
    pad_to(cp * L)
    rows = torch.cat(token_rows) if token_rows else torch.zeros(0, dtype=torch.long)
    return ContextLayout(cp=cp, ratio=ratio, local_len=L, cu_seqlens=cu, token_rows=rows, pad_segments=pads)


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 (rank order) whose backward reduce-scatters the gradient back to each owner."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        P = dist.get_world_size(ctx.group)
        out = grad.new_empty(grad.shape[0] // P, *grad.shape[1:])
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    P = dist.get_world_size(group)
    out = x.new_empty(P * x.shape[0], *x.shape[1:])
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """[n, *C] on every rank -> [P n, *C] in rank order; differentiable when x requires grad."""
    if x.requires_grad:
        return _AllGather.apply(x, group)
    return _all_gather(x, group)


class DistributedShard:
    """Rank `rank`'s `model.context.ContextShard`: its slice of `layout` and the exchanges of its CP group.

    Args:
        layout: the group's `ContextLayout` (the same on every rank).
        rank: this process's rank within the group; group: the CP process group (None: the default group).
        device: where the per-token index tensors live.
    """

    def __init__(self, layout: ContextLayout, rank: int, group=None, device: torch.device | str = "cpu"):
        self.layout, self.rank, self.group = layout, rank, group
        self.device = torch.device(device)
        self.offset = layout.rows(rank)[0]
        self.global_seg = layout.global_segments(self.device)
        self.num_local = len(layout.local_cu(rank)) - 1
        self._carry = [layout.carries_in(r) for r in range(layout.cp)]
        self._block_counts = layout.block_counts() if layout.ratio > 1 else None

    def left_halo(self, x: torch.Tensor, width: int, fill: int | float = 0) -> torch.Tensor:
        """x [L, *C] -> [N, width, *C]: the `width` rows before each local sequence (see the module doc)."""
        L = x.shape[0]
        if width == 0:
            return x.new_full((self.num_local, 0, *x.shape[1:]), fill)
        m = min(width, L)  # every rank's tail; the whole slice when L < width
        gathered = all_gather_rows(x[L - m :], self.group)  # [P m, *C]
        rows = torch.arange(self.offset - width, self.offset)  # stream rows before this slice
        valid = (rows >= self.layout.first_start(self.rank)) & (rows >= 0)
        owner = rows.clamp_min(0) // L
        index = (owner * m + rows.clamp_min(0) - owner * L - (L - m)).clamp(0, gathered.shape[0] - 1)
        halo = gathered.index_select(0, index.to(x.device))  # indexed on every rank: all join the backward
        mask = valid.to(x.device).view(width, *[1] * (x.dim() - 1))
        halo = torch.where(mask, halo, torch.full_like(halo, fill))
        rest = x.new_full((self.num_local - 1, width, *x.shape[1:]), fill)  # later local sequences start here
        return torch.cat([halo.unsqueeze(0), rest])

    def incoming_state(self, A: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
        """A [H, K, K], U [H, K, V] of this rank's last sequence -> the state [H, K, V] entering its first one."""
        K = A.shape[-1]
        pairs = all_gather_rows(torch.cat([A, U], dim=-1).float().unsqueeze(0), self.group)  # [P, H, K, K + V]
        state = torch.zeros_like(U, dtype=torch.float32)
        states = [state]
        for j in range(self.layout.cp - 1):  # the whole chain on every rank: each joins the backward
            state = (pairs[j, ..., :K] @ state + pairs[j, ..., K:]) * float(self._carry[j + 1])
            states.append(state)
        return torch.stack(states)[self.rank]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [L, *C] -> [R, *C]: every rank's rows in stream order (gradient reduce-scattered to the owners)."""
        return all_gather_rows(x, self.group)

    @torch.no_grad()
    def next_rows(self, x: torch.Tensor, fill: int | float = IGNORE_INDEX) -> torch.Tensor:
        """x [L] (ids or labels, no gradient) -> [L]: each row's next row within its sequence, across the slice's
        right edge (`fill` at a sequence's last row): the shift one process makes with `next_token_targets`."""
        whole = next_token_targets(all_gather_rows(x, self.group), self.global_seg, fill)
        return whole[self.offset : self.offset + x.shape[0]]

    @torch.no_grad()
    def gather_blocks(self, keys: torch.Tensor) -> torch.Tensor:
        """This rank's complete-block keys [NB_r, Di] -> every rank's [NB, Di] in stream order."""
        counts = self._block_counts or self.layout.block_counts()
        if keys.shape[0] != counts[self.rank]:
            raise InputError(f"rank {self.rank} pooled {keys.shape[0]} QSA blocks, its slice has {counts[self.rank]}")
        cap = self.layout.local_len // self.layout.ratio
        padded = torch.cat([keys, keys.new_zeros(cap - keys.shape[0], *keys.shape[1:])])
        gathered = all_gather_rows(padded, self.group).view(self.layout.cp, cap, *keys.shape[1:])
        return torch.cat([gathered[r, :n] for r, n in enumerate(counts)])


@dataclass
class ContextBatch:
    """One rank's slice of a packed micro-batch, with everything formed on the whole stream first.

    Attributes:
        input_ids, position_ids: int64 [L]; cu_seqlens: int32 [n + 1] the slice's own boundaries.
        labels: int64 [L] the slice's own labels, unshifted (-100 on padding): the model shifts them across the
            edge (`DistributedShard.next_rows`).
        targets: int64 [L] next-token targets (-100: none, padding included).
        num_mtp_targets: the MTP head's targets (`labels[t + 2]` within a sequence) among this slice's rows.
        inference_logprobs, advantages: float [L] shifted like the targets (RL), or None.
        routed_experts: int64 [L, layers, k] or None.
        shard: the rank's `DistributedShard` (the model's `cp` argument).
        source: the whole micro-batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    targets: torch.Tensor
    num_mtp_targets: int
    inference_logprobs: torch.Tensor | None
    advantages: torch.Tensor | None
    routed_experts: torch.Tensor | None
    shard: DistributedShard
    source: PackedBatch

    @property
    def real_tokens(self) -> int:
        """Input tokens (not padding) in this slice."""
        lo, hi = self.shard.layout.rows(self.shard.rank)
        rows = self.shard.layout.token_rows
        return int(((rows >= lo) & (rows < hi)).sum())


@dataclass
class ContextGroup:
    """This process's CP group: `size` consecutive ranks, this one at `rank` within it.

    Attributes:
        group: the process group (None when size == 1); rank, size: within it.
        index, count: which of the `world / size` groups this is (the data-parallel rank and size).
        ratio: the QSA block size the layouts respect.
    """

    group: object
    rank: int
    size: int
    index: int
    count: int
    ratio: int = 1

    def shard(self, batch: PackedBatch, device: torch.device | str = "cpu") -> ContextBatch:
        """This rank's `ContextBatch` of `batch` (host planning; the same layout on every rank of the group)."""
        if batch.position_ids.dim() != 1 or batch.pixel_values is not None:
            raise InputError("context parallelism takes text-only batches with [T] position_ids")
        layout = plan_layout(batch.lengths, self.size, self.ratio)
        lo, hi = layout.rows(self.rank)

        def local(x: torch.Tensor | None, fill) -> torch.Tensor | None:
            return None if x is None else layout.pad(x, fill)[lo:hi].to(device)

        seg = make_segments(batch.cu_seqlens, batch.num_tokens)
        shifted = {
            name: None if x is None else next_token_targets(x, seg, 0.0)  # aligned with the prediction at t
            for name, x in (("lp", batch.inference_logprobs), ("adv", batch.advantages))
        }
        two_ahead = next_token_targets(next_token_targets(batch.labels, seg, IGNORE_INDEX), seg, IGNORE_INDEX)
        return ContextBatch(
            input_ids=local(batch.input_ids, 0),
            position_ids=local(batch.position_ids, 0),
            cu_seqlens=torch.tensor(layout.local_cu(self.rank), dtype=torch.int32),
            labels=local(batch.labels, IGNORE_INDEX),
            targets=layout.targets(batch.labels, batch.cu_seqlens)[lo:hi].to(device),
            num_mtp_targets=int((layout.pad(two_ahead, IGNORE_INDEX)[lo:hi] != IGNORE_INDEX).sum()),
            inference_logprobs=local(shifted["lp"], 0.0),
            advantages=local(shifted["adv"], 0.0),
            routed_experts=local(batch.routed_experts, 0),
            shard=DistributedShard(layout, self.rank, self.group, device),
            source=batch,
        )


def context_group(rank: int, world: int, cp: int, ratio: int = 1) -> ContextGroup:
    """Split the default process group into groups of `cp` consecutive ranks (collective: every rank calls it).

    Raises:
        ConfigError: `cp` does not divide the world size.
    """
    if cp < 1 or world % cp:
        raise ConfigError(f"parallel.cp={cp} must divide the world size {world}")
    mine = None
    for index in range(world // cp):  # every rank creates every group, in the same order
        ranks = list(range(index * cp, (index + 1) * cp))
        group = dist.new_group(ranks) if cp > 1 else None
        if rank in ranks:
            mine = group
    return ContextGroup(group=mine, rank=rank % cp, size=cp, index=rank // cp, count=world // cp, ratio=ratio)
