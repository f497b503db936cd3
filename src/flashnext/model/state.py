"""The serving state contract: what each stateful module keeps per sequence, and the steps that continue it.

A stateful module (GDN, PLE, QSA attention) declares its per-sequence state with `state_spec(max_len)`: a typed
record (`GDNState`, `PLEState`, `QSAState`) whose fields are `StateSpec`s (per-sequence shape, dtype, the value of an
empty sequence, and how the state behaves when positions are taken back). `serve.cache.StateCache` allocates one
fixed-address buffer `[S, *shape]` per field from those declarations, with S slots, and hands each module the same
record type holding the buffers. Nothing else derives a state shape.

What a forward computes is one step context (`Step`), which layers ask instead of taking boolean flags: its `kind`
(`TRAIN`, `PREFILL`, `DECODE`, `VERIFY`), whether the prepared serving weights apply (`fused`: any serving step) and
whether it is the static decode graph (`static`). A training forward is `TRAIN_STEP` (the plain path), the default
of every layer's `step` argument; a stateful module without `state` is in a training forward (`step_of`).

A serving step (`StepBatch`, a `Step` built by `make_step`) is a flat stream of N entries (prompt chunks, or one
decode token each). Entry i belongs to cache slot `slots[i]` and continues a sequence of which `cached[i]` tokens are
already in the cache, so its tokens sit at positions `cached[i] .. cached[i] + L_i - 1`. A module's forward receives
`StepState(step, bufs)` (its buffers and the step's slot mapping) as `state`, reads its entries' rows with
`state.read`, computes with the same ops as training (which take the state in and return it out), and writes the
live entries' rows back with `state.write`.

Padding: an entry whose slot is the cache's scratch slot (`live[i]` False) is computed but its state is never
written back to a real slot and the caller drops its output; a zero-length entry has no tokens and writes nothing.

Rotary positions: by default a token's rotary position is its cache row (`cached + offset`). An entry that
carries MRoPE positions (a prompt with images) gives its prompt's `[3, L]` table and its `delta`: row r < L
rotates at `table[:, r]`, a later row at `r + delta` on all three axes (the reference's decode rule). Cache rows
(`seg.position_ids`) stay the sequential offsets either way.

Static steps (`make_decode_step`; `make_chunk_step`, the same with L tokens per entry): a step of a fixed number
of entries whose metadata are device tensors only (`StepBatch.static`). Every entry, padding included, reads and
writes its slot (padding entries the scratch slot, whose contents nobody reads), QSA blocks are planned per entry
on the device (the ceil(L / c) blocks its tokens may complete), and queries score every block row of the cache
under a visibility mask, so no op reads a tensor value on the host and the shapes depend only on the number of
entries (and L): the step can be compiled once per size (`serve.decode_graph`, `serve.chunk_graph`) or captured
as a CUDA graph.

Taking positions back (speculative decoding, a rejected draft): a `positional` state is indexed by position, so
rows past the accepted length are invisible to every later query and overwritten before they are read; `window`
and `recurrent` states hold the state after the last token and must be restored (`StateCache.snapshot` /
`restore`) and the accepted tokens fed again.

Legend: T tokens, N entries, S slots, W window rows, C channels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Generic, NamedTuple, TypeVar

import torch

from flashnext.batch import Segments, make_segments

WINDOW = "window"  # the last W rows of a per-token stream (conv inputs, n-gram context)
RECURRENT = "recurrent"  # a state that summarises every token so far (the delta rule's)
POSITIONAL = "positional"  # one row per position (QSA keys/values): rows past a length are never read

TRAIN = "train"  # a training (or plain evaluation) forward: no cache, plain weights
PREFILL = "prefill"  # a serving step with a prompt chunk (more than one token) in it
DECODE = "decode"  # a serving step of one new token per entry
VERIFY = "verify"  # a serving step scoring speculative drafts (the entries carry their drafts)


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence state tensor a module keeps between serving steps.

    Attributes:
        shape: per-sequence shape (the cache adds a leading slot dim).
        dtype: None = the cache's activation dtype.
        fill: the value of an empty sequence (0, or e.g. EOS for an n-gram context).
        kind: `WINDOW`, `RECURRENT` or `POSITIONAL` (how it behaves when positions are taken back).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    fill: int | float = 0
    kind: str = WINDOW


@dataclass
class GDNState:
    """Gated DeltaNet: `conv` [S, K-1, conv_dim] the last pre-conv q/k/v rows; `recurrent` fp32 [S, Hv, Dk, Dv]."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class PLEState:
    """PLE: `context` int64 [S, ngram_size-1] the last token ids (EOS before the start); `conv` [S, W, hc*D] the
    last rows into the dilated conv (W = (K-1) * ngram_size)."""

    context: torch.Tensor
    conv: torch.Tensor


@dataclass
class QSAState:
    """QSA attention, rows by position: rotated keys `k` and values `v` [S, Lc, Hkv, D], raw indexer keys `raw_k`
    [S, Lc, Di], and `block_k` [S, Lc/c, Di], each complete block's pooled, normed, rotated key (written once when
    the block completes). Lc = (max_len // c + 1) * c holds a whole tail block past the last position."""

    k: torch.Tensor
    v: torch.Tensor
    raw_k: torch.Tensor
    block_k: torch.Tensor


def state_buffers(state) -> dict[str, torch.Tensor]:
    """The fields of a typed state record (buffers, or `StateSpec`s for a declaration), by name."""
    return {f.name: getattr(state, f.name) for f in fields(state)}


B = TypeVar("B")


@dataclass
class Step:
    """What a forward computes (see the module doc); layers ask it instead of taking boolean flags.

    Attributes:
        kind: `TRAIN`, `PREFILL`, `DECODE` or `VERIFY`.
        static: a fixed-shape step built by `make_decode_step` / `make_chunk_step` (see the module doc).
    """

    kind: str = TRAIN
    static: bool = False

    @property
    def fused(self) -> bool:
        """Whether the prepared serving weights apply (`model.fused`'s fast paths): any serving step."""
        return self.kind != TRAIN


TRAIN_STEP = Step()  # a training forward: the plain path


class BlockPlan(NamedTuple):
    """QSA blocks completed by a step's live entries (`plan_blocks`), shared by the model's QSA layers.

    Attributes:
        slot, block: int64 [B] each block's slot and index; cos, sin: [B, R] rotated at its first position.
        done: static steps: bool [B], whether each candidate block completes in this step (a static step plans
            ceil(L / c) candidates per entry and rewrites the others unchanged); None otherwise.
        most: host int, the most complete blocks any query of the step sees (a static step scores every block row
            of the cache instead).
    """

    slot: torch.Tensor
    block: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    done: torch.Tensor | None
    most: int


@dataclass(kw_only=True)
class StepBatch(Step):
    """Metadata of one serving step (a `Step` of kind `PREFILL`, `DECODE` or `VERIFY`).

    Attributes:
        seg: segments of the step's stream; `position_ids` are the absolute positions `cached + offset`.
        slots: int64 [N] cache slot of every entry (padding entries point at the scratch slot).
        cached: int64 [N] tokens already cached per entry; `cached_host` the same as a host list (None on a static
            step).
        live: bool [N], entries whose state is written back (a real slot and at least one token);
            `live_host` the same as a host list; `live_idx` int64 [n_live] their indices, `live_slots` their slots
            (on a static step: None, None and `slots`: every entry is written, padding into the scratch slot).
        tok_slot: int64 [T] slot of every token.
        blocks: the QSA blocks the step completes (`plan_blocks`' result, stored by the model for its QSA layers).
        mrope: per entry None (rotary position = row) or `(table int64 [3, L], delta)` (see the module doc);
            None when no entry has MRoPE positions.
        rope_positions: int64 [3, T] rotary positions of the step's tokens when `mrope` is set, else None
            (the rotary then uses `seg.position_ids`).
        slot_run: `(first, N)` when the entries' slots are `first, first+1, ...` in order and every entry is live
            (the usual decode batch): per-slot state is then read and written as one contiguous slice of each
            buffer (`gather`, `store`) instead of by index; None otherwise.
        scratch_slot: static steps: the cache's scratch slot (where padding, and a block plan's unused candidates,
            write).
        kept: a verify step of short entries (`serve.speculative`): a list the stateful layers add to
            (`StepState.keep`): per window buffer the stream rows the step fed (flat [T, ...]), per recurrent one
            the state after every position ([L, N, ...]), so a rejection keeps the accepted prefix; else None.
    """

    kind: str = PREFILL
    seg: Segments
    slots: torch.Tensor
    cached: torch.Tensor
    cached_host: list[int] | None
    live: torch.Tensor
    live_host: list[bool] | None
    live_idx: torch.Tensor | None
    live_slots: torch.Tensor
    tok_slot: torch.Tensor
    blocks: BlockPlan | None = None
    mrope: list | None = None
    rope_positions: torch.Tensor | None = None
    slot_run: tuple[int, int] | None = None
    scratch_slot: int = -1
    kept: list | None = None

    def gather(self, buf: torch.Tensor) -> torch.Tensor:
        """The entries' rows of a per-slot buffer [S, ...] -> [N, ...]: a view when `slot_run` is set, else a copy.

        A view aliases the cache: read it before `store` writes the same buffer.
        """
        if self.slot_run is not None:
            return buf.narrow(0, *self.slot_run)
        return buf.index_select(0, self.slots)

    def store(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Write every live entry's row of `rows` [N, ...] into its slot of `buf` [S, ...]."""
        if self.slot_run is not None:
            target = buf.narrow(0, *self.slot_run)
            if target.data_ptr() != rows.data_ptr():  # not computed in place already
                target.copy_(rows)
        elif self.static:  # every entry; padding rows land in the scratch slot (no host read of which are live)
            buf.index_copy_(0, self.slots, rows.to(buf.dtype))
        elif any(self.live_host):
            buf.index_copy_(0, self.live_slots, rows.index_select(0, self.live_idx).to(buf.dtype))


@dataclass
class StepState(Generic[B]):
    """What a module's forward gets as `state` in a serving step: the step and the module's own buffers `bufs`
    (a `GDNState`, `PLEState`, `QSAState`, or a decoder layer's dict of them)."""

    step: StepBatch
    bufs: B

    def read(self, buf: torch.Tensor) -> torch.Tensor:
        """The step's entries' rows of `buf` [S, ...] -> [N, ...] (a view of the cache on a slot run)."""
        return self.step.gather(buf)

    def write(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Store the live entries' rows [N, ...] into their slots of `buf`."""
        self.step.store(buf, rows)

    @property
    def keeps(self) -> bool:
        """Whether the step keeps per-position material (`StepBatch.kept`)."""
        return self.step.kept is not None

    def keep(self, buf: torch.Tensor, rows: torch.Tensor) -> None:
        """Record a window buffer's fed stream rows [T, ...] or a recurrent one's states per position [L, N, ...]."""
        self.step.kept.append((buf, rows))

    def part(self, name: str) -> StepState:
        """The state of one part of a layer (`bufs` a dict by role, e.g. "ple")."""
        return StepState(self.step, self.bufs[name])


def step_of(state: StepState | None) -> Step:
    """The step a module's `state` belongs to; `TRAIN_STEP` without state (a training forward)."""
    return TRAIN_STEP if state is None else state.step


def make_step(
    cu_seqlens: list[int],
    slots: list[int],
    cached: list[int],
    scratch_slot: int,
    device: torch.device | str = "cpu",
    mrope: list | None = None,
    kind: str | None = None,
) -> StepBatch:
    """Build a `StepBatch` from host lists (N entries; `slots[i] == scratch_slot` marks padding).

    `mrope`: optional per-entry None or `(table int64 [3, L], delta)` MRoPE positions (see the module doc).
    `kind`: the step's kind; by default `DECODE` when every entry has one token, else `PREFILL` (a step scoring
    drafts says `VERIFY`).
    """
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    if kind is None:
        kind = DECODE if all(n == 1 for n in lengths) else PREFILL
    elif kind not in (PREFILL, DECODE, VERIFY):
        raise ValueError(f"make_step: kind {kind!r} is not a serving step's ({PREFILL!r}, {DECODE!r}, {VERIFY!r})")
    cached_t = torch.tensor(cached, dtype=torch.long)
    seg = _step_segments(cu_seqlens, lengths, cached_t, device)
    seq_idx = seg.seq_idx
    live_host = [s != scratch_slot and n > 0 for s, n in zip(slots, lengths, strict=True)]
    slots_t = torch.tensor(slots, dtype=torch.long)
    live_idx = torch.tensor([i for i, live in enumerate(live_host) if live], dtype=torch.long)
    rope_positions = None
    if mrope is not None and any(m is not None for m in mrope):
        rope_positions = torch.cat(
            [rope_rows(m, torch.arange(c, c + n)) for m, c, n in zip(mrope, cached, lengths, strict=True)],
            dim=1,
        ).to(device)
    else:
        mrope = None
    N = len(slots)
    run = N > 0 and all(live_host) and slots == list(range(slots[0], slots[0] + N))
    return StepBatch(
        kind=kind,
        slot_run=(slots[0], N) if run else None,
        seg=seg,
        mrope=mrope,
        rope_positions=rope_positions,
        slots=slots_t.to(device),
        cached=cached_t.to(device),
        cached_host=list(cached),
        live=torch.tensor(live_host, dtype=torch.bool).to(device),
        live_host=live_host,
        live_idx=live_idx.to(device),
        live_slots=slots_t[live_idx].to(device),
        tok_slot=slots_t.to(device)[seq_idx],
    )


def _step_segments(cu_seqlens: list[int], lengths: list[int], cached: torch.Tensor, device) -> Segments:
    """The step's `Segments`: each entry's new tokens at positions `cached[i] + 0, 1, ...`."""
    T = cu_seqlens[-1]
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    if T == len(lengths) and all(n == 1 for n in lengths):  # decode: entry i is token i (make_segments' result)
        seq_idx = torch.arange(T, device=device)
        return Segments(
            cu_seqlens=cu.to(device),
            position_ids=cached.to(device),
            max_seqlen=1,
            seq_idx=seq_idx,
            seq_start=seq_idx,
            lengths=lengths,
            cu_host=list(cu_seqlens),
            pos_in_seq=torch.zeros(T, dtype=torch.long, device=device),
        )
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    pos_in_seq = torch.arange(T) - torch.tensor(cu_seqlens[:-1], dtype=torch.long)[seq_idx]
    positions = (cached[seq_idx] + pos_in_seq).to(device)
    return make_segments(cu, T, positions, device=device)


def make_decode_step(slots: torch.Tensor, cached: torch.Tensor, scratch_slot: int) -> StepBatch:
    """A static decode step (see the module doc): entry i feeds one token to slot `slots[i]` after `cached[i]`.

    Args:
        slots: int64 [N] cache slots on the model's device (`scratch_slot` marks padding).
        cached: int64 [N] tokens already cached per entry (padding: any valid row, e.g. 0).
        scratch_slot: the cache's scratch slot.

    Built from device ops only (no host list is read or copied to the device), so it can run inside a compiled
    or captured graph; the host fields are constants of N.
    """
    N = slots.shape[0]
    device = slots.device
    seq_idx = torch.arange(N, device=device)
    seg = Segments(
        cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=device),
        position_ids=cached,
        max_seqlen=1,
        seq_idx=seq_idx,
        seq_start=seq_idx,
        lengths=[1] * N,
        cu_host=list(range(N + 1)),
        pos_in_seq=torch.zeros(N, dtype=torch.long, device=device),
    )
    return StepBatch(
        kind=DECODE,
        seg=seg,
        slots=slots,
        cached=cached,
        cached_host=None,
        live=slots != scratch_slot,
        live_host=None,
        live_idx=None,
        live_slots=slots,
        tok_slot=slots,
        static=True,
        scratch_slot=scratch_slot,
    )


def make_chunk_step(slots: torch.Tensor, cached: torch.Tensor, length: int, scratch_slot: int) -> StepBatch:
    """A static step of N entries feeding `length` tokens each (a prompt chunk per entry): entry i's tokens go to
    slot `slots[i]` after `cached[i]`, at positions `cached[i] .. cached[i] + length - 1`.

    As `make_decode_step` (which it equals at `length` 1): device metadata only, every entry's state written, its
    shapes constants of (N, `length`), so it can run inside a compiled graph (`serve.chunk_graph.ChunkGraph`).
    Every entry is live (no padding entries: a chunk graph runs one real entry per call)."""
    if length == 1:
        return make_decode_step(slots, cached, scratch_slot)
    N, device = slots.shape[0], slots.device
    offset = torch.arange(length, device=device).repeat(N)
    seq_idx = torch.arange(N, device=device).repeat_interleave(length)
    seg = Segments(
        cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=device) * length,
        position_ids=cached[seq_idx] + offset,
        max_seqlen=length,
        seq_idx=seq_idx,
        seq_start=seq_idx * length,
        lengths=[length] * N,
        cu_host=[i * length for i in range(N + 1)],
        pos_in_seq=offset,
    )
    return StepBatch(
        kind=PREFILL,
        seg=seg,
        slots=slots,
        cached=cached,
        cached_host=None,
        live=torch.ones(N, dtype=torch.bool, device=device),
        live_host=None,
        live_idx=None,
        live_slots=slots,
        tok_slot=slots[seq_idx],
        static=True,
        scratch_slot=scratch_slot,
    )


def rope_rows(mrope, rows: torch.Tensor) -> torch.Tensor:
    """Rotary positions int64 [3, n] of cache rows `rows` [n] of an entry with MRoPE `(table, delta)` or None."""
    if mrope is None:
        return rows.expand(3, -1)
    table, delta = mrope
    out = (rows + delta).expand(3, -1).clone()
    inside = rows < table.shape[1]
    out[:, inside] = table[:, rows[inside]]
    return out


def plan_blocks(step: StepBatch, ratio: int, rotary, dtype: torch.dtype) -> BlockPlan:
    """The QSA blocks of c = `ratio` tokens that the step's live entries complete, rotated by `rotary` (host math;
    on a static step device math: `_plan_decode_blocks`). The caller stores the plan as `step.blocks`."""
    if step.static:
        return _plan_decode_blocks(step, ratio, rotary, dtype)
    slots, idx, most, pos = [], [], 0, []
    slot_host = step.slots.tolist()
    for i, (n, cached) in enumerate(zip(step.seg.lengths, step.cached_host, strict=True)):
        most = max(most, (cached + n) // ratio)
        if step.live_host[i]:
            done = range(cached // ratio, (cached + n) // ratio)
            slots.extend([slot_host[i]] * len(done))
            idx.extend(done)
            if step.mrope is not None:  # each block rotates at its first token's (MRoPE) position
                pos.append(rope_rows(step.mrope[i], torch.arange(done.start, done.stop) * ratio))
    dev = step.slots.device
    idx_t = torch.tensor(idx, dtype=torch.long, device=dev)
    if step.mrope is None:
        cos, sin = rotary(idx_t * ratio, dtype)
    else:
        cos, sin = rotary(
            torch.cat(pos, dim=1).to(dev) if pos else torch.zeros(3, 0, dtype=torch.long, device=dev), dtype
        )
    return BlockPlan(torch.tensor(slots, dtype=torch.long, device=dev), idx_t, cos, sin, None, most)


def _plan_decode_blocks(step: StepBatch, ratio: int, rotary, dtype: torch.dtype) -> BlockPlan:
    """Static step of L tokens per entry: entry i's candidates are the last M = ceil(L / c) blocks its tokens can
    complete, `end // c - 1 - j` for j < M with `end = cached + L` (no chunk of L tokens completes more); `done`
    marks the live entries' candidates their tokens do complete. A candidate before block 0 points at block 0 of
    the scratch slot (at L = 1, of its own slot: its only candidate, so nothing else writes that row), so no two
    candidates of a real slot name one block."""
    L = step.seg.max_seqlen
    M = -(-L // ratio)
    end = step.cached + L
    idx = (end // ratio - 1)[:, None] - torch.arange(M, device=end.device)  # [N, M]
    done = step.live[:, None] & (idx >= step.cached[:, None] // ratio) & (idx >= 0)
    slot = step.slots[:, None].expand(-1, M)
    if M > 1:
        slot = torch.where(idx >= 0, slot, slot.new_full((), step.scratch_slot))
    idx = idx.clamp_min(0).flatten()
    cos, sin = rotary(idx * ratio, dtype)
    return BlockPlan(slot.flatten(), idx, cos, sin, done.flatten(), 0)
