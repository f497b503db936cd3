"""Inputs of a serving step: a flat stream whose sequences continue per-slot cached state.

A step's stream holds N entries (chunks of prompts, or one decode token each). Entry i belongs to cache slot
`slots[i]` and continues a sequence of which `cached[i]` tokens are already in the cache, so its tokens sit at
positions `cached[i] .. cached[i] + L_i - 1`. The model's layers read and write their per-slot state through the
layer cache objects of `flashnext.serve.cache`; everything else is the training code on the flat stream.

Padding: an entry whose slot is the cache's scratch slot (`live[i]` False) is computed but its state is never
written back to a real slot and the caller drops its output; a zero-length entry has no tokens and writes nothing.

Windowed mixers (GDN conv, PLE conv, n-gram context) run on an *extended* stream: each entry's W cached rows
followed by its L new rows, so the causal conv of `ops.conv` sees the previous tokens exactly as in one pass.

Rotary positions: by default a token's rotary position is its cache row (`cached + offset`). An entry that
carries MRoPE positions (a prompt with images) gives its prompt's `[3, L]` table and its `delta`: row r < L
rotates at `table[:, r]`, a later row at `r + delta` on all three axes (the reference's decode rule). Cache rows
(`seg.position_ids`) stay the sequential offsets either way.

Legend: T tokens, N entries, W window rows, C channels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashnext.batch import Segments, make_segments
from flashnext.ops.conv import causal_conv1d_varlen


@dataclass
class StepBatch:
    """Metadata of one serving step.

    Attributes:
        seg: segments of the step's stream; `position_ids` are the absolute positions `cached + offset`.
        slots: int64 [N] cache slot of every entry (padding entries point at the scratch slot).
        cached: int64 [N] tokens already cached per entry; `cached_host` the same as a host list.
        live: bool [N], entries whose state is written back (a real slot and at least one token);
            `live_host` the same as a host list; `live_idx` int64 [n_live] their indices, `live_slots` their slots.
        tok_slot: int64 [T] slot of every token.
        new_blocks: QSA blocks completed by this step's live entries, `(slot [B], block [B], cos [B, R],
            sin [B, R])` rotated at each block's first position (set by the model, shared by its QSA layers).
        max_visible_blocks: host int, the most complete QSA blocks any query of the step sees.
        mrope: per entry None (rotary position = row) or `(table int64 [3, L], delta)` (see the module doc);
            None when no entry has MRoPE positions.
        rope_positions: int64 [3, T] rotary positions of the step's tokens when `mrope` is set, else None
            (the rotary then uses `seg.position_ids`).
        slot_run: `(first, N)` when the entries' slots are `first, first+1, ...` in order and every entry is live
            (the usual decode batch): per-slot state is then read and written as one contiguous slice of each
            buffer (`gather`, `store`) instead of by index; None otherwise.
    """

    seg: Segments
    slots: torch.Tensor
    cached: torch.Tensor
    cached_host: list[int]
    live: torch.Tensor
    live_host: list[bool]
    live_idx: torch.Tensor
    live_slots: torch.Tensor
    tok_slot: torch.Tensor
    new_blocks: tuple | None = None
    max_visible_blocks: int = 0
    mrope: list | None = None
    rope_positions: torch.Tensor | None = None
    slot_run: tuple[int, int] | None = None
    _ext: dict = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        """Every entry has exactly one token (the recurrent single-step paths apply)."""
        return all(n == 1 for n in self.seg.lengths)

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
        elif any(self.live_host):
            buf.index_copy_(0, self.live_slots, rows.index_select(0, self.live_idx).to(buf.dtype))

    def extended(self, W: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index maps of the stream extended by W history rows before every entry (memoised per W).

        Returns:
            pos_ext int64 [T + N*W] (offset within the extended entry), real int64 [T] (row of each token in
            the extended stream), head int64 [N, W] (the entry's W history rows), tail int64 [N, W] (the entry's
            last W extended rows: its next window).
        """
        if W not in self._ext:
            lengths = self.seg.lengths
            dev = self.seg.seq_idx.device
            N = len(lengths)
            ext_len = torch.tensor([n + W for n in lengths], dtype=torch.long)
            ext_start = torch.cumsum(ext_len, 0) - ext_len
            total = int(ext_len.sum())
            seq = torch.repeat_interleave(torch.arange(N), ext_len, output_size=total)
            pos_ext = torch.arange(total) - ext_start[seq]
            real = self.seg.seq_idx.cpu() * W + torch.arange(self.seg.num_tokens) + W
            head = ext_start[:, None] + torch.arange(W)
            tail = (ext_start + ext_len - W)[:, None] + torch.arange(W)
            self._ext[W] = tuple(t.to(dev) for t in (pos_ext, real, head, tail))
        return self._ext[W]

    def with_history(self, x: torch.Tensor, hist: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put each entry's W cached rows before its new rows.

        Args:
            x: [T, *C] new rows; hist: [N, W, *C] cached rows of each entry's slot (zeros/EOS for a fresh one).

        Returns:
            x_ext [T + N*W, *C] and pos_ext [T + N*W].
        """
        N, W = hist.shape[:2]
        pos_ext, real, head, _ = self.extended(W)
        if self.is_decode:  # [hist, token] per entry is already the extended layout
            return torch.cat([hist.to(x.dtype), x.unsqueeze(1)], dim=1).flatten(0, 1), pos_ext
        x_ext = x.new_empty(x.shape[0] + N * W, *x.shape[1:])
        x_ext.index_copy_(0, real, x)
        x_ext.index_copy_(0, head.flatten(), hist.reshape(N * W, *x.shape[1:]).to(x.dtype))
        return x_ext, pos_ext

    def conv(self, x_ext: torch.Tensor, pos_ext: torch.Tensor, weight: torch.Tensor, W: int, dilation: int = 1):
        """`ops.conv.causal_conv1d_varlen` over the extended stream, returned at the real rows: [T, C].

        A decode step computes only each entry's last row, with the same taps in the same order.
        """
        if not self.is_decode:
            return causal_conv1d_varlen(x_ext, weight, pos_ext, dilation)[self.extended(W)[1]]
        K = weight.shape[-1]
        out_dtype = weight.dtype
        acc = torch.promote_types(out_dtype, torch.float32)
        x3 = x_ext.to(out_dtype).to(acc).view(-1, W + 1, x_ext.shape[-1])
        weight = weight.to(acc)
        out = x3[:, W] * weight[:, K - 1]
        for k in range(1, K):
            out = out + x3[:, W - k * dilation] * weight[:, K - 1 - k]
        return out.to(out_dtype)

    def write_window(self, buf: torch.Tensor, x_ext: torch.Tensor) -> None:
        """Store each live entry's last W extended rows as its slot's next window. buf: [S, W, *C]."""
        W = buf.shape[1]
        if W == 0 or not any(self.live_host):
            return
        if self.slot_run is not None and self.is_decode:  # entry i's window: rows 1..W of its [W + 1] block
            buf.narrow(0, *self.slot_run).copy_(x_ext.view(-1, W + 1, *x_ext.shape[1:])[:, 1:])
            return
        rows = self.extended(W)[3].index_select(0, self.live_idx).flatten()
        n = self.live_idx.shape[0]
        buf.index_copy_(0, self.live_slots, x_ext.index_select(0, rows).view(n, W, *x_ext.shape[1:]).to(buf.dtype))


def make_step(
    cu_seqlens: list[int],
    slots: list[int],
    cached: list[int],
    scratch_slot: int,
    device: torch.device | str = "cpu",
    mrope: list | None = None,
) -> StepBatch:
    """Build a `StepBatch` from host lists (N entries; `slots[i] == scratch_slot` marks padding).

    `mrope`: optional per-entry None or `(table int64 [3, L], delta)` MRoPE positions (see the module doc).
    """
    T = cu_seqlens[-1]
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    cached_t = torch.tensor(cached, dtype=torch.long)
    if T == len(lengths) and all(n == 1 for n in lengths):  # decode: entry i is token i (make_segments' result)
        seq_idx = torch.arange(T, device=device)
        seg = Segments(
            cu_seqlens=cu.to(device),
            position_ids=cached_t.to(device),
            max_seqlen=1,
            seq_idx=seq_idx,
            seq_start=seq_idx,
            lengths=lengths,
            cu_host=list(cu_seqlens),
            pos_in_seq=torch.zeros(T, dtype=torch.long, device=device),
        )
    else:
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
        pos_in_seq = torch.arange(T) - torch.tensor(cu_seqlens[:-1], dtype=torch.long)[seq_idx]
        positions = (cached_t[seq_idx] + pos_in_seq).to(device)
        seg = make_segments(cu, T, positions, device=device)
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


def rope_rows(mrope, rows: torch.Tensor) -> torch.Tensor:
    """Rotary positions int64 [3, n] of cache rows `rows` [n] of an entry with MRoPE `(table, delta)` or None."""
    if mrope is None:
        return rows.expand(3, -1)
    table, delta = mrope
    out = (rows + delta).expand(3, -1).clone()
    inside = rows < table.shape[1]
    out[:, inside] = table[:, rows[inside]]
    return out


def plan_blocks(step: StepBatch, ratio: int, rotary, dtype: torch.dtype) -> None:
    """Fill `step.new_blocks` and `step.max_visible_blocks` for QSA blocks of c = `ratio` tokens (host math)."""
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
    step.new_blocks = (torch.tensor(slots, dtype=torch.long, device=dev), idx_t, cos, sin)
    step.max_visible_blocks = most
