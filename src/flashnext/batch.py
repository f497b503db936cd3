"""Flat token streams: `Segments` (cu_seqlens, positions), padded <-> packed helpers, and `flatten_inputs`, the
checked entry of every model forward.

Legend: T = tokens in the flat stream, N = sequences, B/S = padded batch/sequence dims.

Input checks here are host-side (types, dtypes, shapes): they cost no device read beyond the ones the layout
needs anyway (`cu_seqlens` is read once; a padded batch's mask is checked for holes once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashnext.errors import InputError


@dataclass
class Segments:
    """Sequence boundaries of a flat token stream.

    Attributes:
        cu_seqlens: int32 [N+1], 0 first, non-decreasing, last == T (equal neighbours = zero-length sequence).
        position_ids: int64 [T] (text) or [3, T] (MRoPE t/h/w).
        max_seqlen: longest sequence (host int).
        seq_idx: int64 [T], sequence index of every token.
        seq_start: int64 [T], flat index of the first token of every token's sequence.
        lengths: host list of the N sequence lengths.
        cu_host: host list copy of `cu_seqlens` (read once; no device sync afterwards).
        pos_in_seq: int64 [T], offset of each token from its sequence start (independent of `position_ids`).
        memo: derived index maps built on first use (see `history_layout`), so the layers of one forward share them.
    """

    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    max_seqlen: int
    seq_idx: torch.Tensor
    seq_start: torch.Tensor
    lengths: list[int]
    cu_host: list[int]
    pos_in_seq: torch.Tensor
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.seq_idx.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one token (a serving decode step): the single-token paths apply."""
        return self.max_seqlen == 1 and len(self.lengths) == self.num_tokens


@dataclass
class HistoryLayout:
    """Index maps of a stream extended by W history rows before every sequence (see `prepend_history`).

    Attributes:
        pos: int64 [T + N*W], offset of every extended row from its extended sequence's start.
        real: int64 [T], the extended row of every token of the stream.
        head: int64 [N, W], the extended rows of each sequence's history.
        tail: int64 [N, W], each extended sequence's last W rows (the history that follows it).
    """

    pos: torch.Tensor
    real: torch.Tensor
    head: torch.Tensor
    tail: torch.Tensor


def history_layout(seg: Segments, W: int) -> HistoryLayout:
    """The `HistoryLayout` of `seg` with W history rows per sequence (host math, or device math when every sequence
    has the same length; memoised on `seg`)."""
    key = ("history", W)
    if key not in seg.memo and len(set(seg.lengths)) == 1:  # L tokens per sequence: device ops only (a compiled
        N, L, dev = len(seg.lengths), seg.lengths[0], seg.seq_idx.device  # decode or chunk step)
        block = torch.arange(N, device=dev)[:, None] * (W + L)
        head = block + torch.arange(W, device=dev)
        pos = torch.arange(W + L, device=dev).repeat(N)
        real = (block + W + torch.arange(L, device=dev)).flatten()
        seg.memo[key] = HistoryLayout(pos, real, head, block + L + torch.arange(W, device=dev))
    if key not in seg.memo:
        lengths = seg.lengths
        N = len(lengths)
        ext_len = torch.tensor([n + W for n in lengths], dtype=torch.long)
        ext_start = torch.cumsum(ext_len, 0) - ext_len
        total = int(ext_len.sum())
        seq = torch.repeat_interleave(torch.arange(N), ext_len, output_size=total)
        pos = torch.arange(total) - ext_start[seq]
        tok_seq = torch.repeat_interleave(torch.arange(N), torch.tensor(lengths, dtype=torch.long))
        real = tok_seq * W + torch.arange(seg.num_tokens) + W
        head = ext_start[:, None] + torch.arange(W)
        tail = (ext_start + ext_len - W)[:, None] + torch.arange(W)
        dev = seg.seq_idx.device
        seg.memo[key] = HistoryLayout(*(t.to(dev) for t in (pos, real, head, tail)))
    return seg.memo[key]


def prepend_history(x: torch.Tensor, hist: torch.Tensor, seg: Segments) -> tuple[torch.Tensor, HistoryLayout]:
    """Put each sequence's W history rows before its rows: the stream a windowed op sees across steps.

    Args:
        x: [T, *C] rows of the stream; hist: [N, W, *C] rows that precede each sequence (cast to x's dtype).

    Returns:
        x_ext [T + N*W, *C] and the stream's `HistoryLayout` (ext row `layout.real[t]` is token t).
    """
    N, W = hist.shape[:2]
    layout = history_layout(seg, W)
    if seg.is_decode:  # [history, token] per sequence is already the extended order
        return torch.cat([hist.to(x.dtype), x.unsqueeze(1)], dim=1).flatten(0, 1), layout
    x_ext = x.new_empty(x.shape[0] + N * W, *x.shape[1:])
    x_ext.index_copy_(0, layout.real, x)
    x_ext.index_copy_(0, layout.head.flatten(), hist.reshape(N * W, *x.shape[1:]).to(x.dtype))
    return x_ext, layout


def last_rows(x_ext: torch.Tensor, layout: HistoryLayout, seg: Segments) -> torch.Tensor:
    """Each extended sequence's last W rows: [N, W, *C] (the history of the next step). x_ext: [T + N*W, *C]."""
    N, W = layout.tail.shape
    if seg.is_decode:  # rows 1..W of each [W + 1]-row block
        return x_ext.view(N, W + 1, *x_ext.shape[1:])[:, 1:]
    return x_ext.index_select(0, layout.tail.flatten()).view(N, W, *x_ext.shape[1:])


def integer_tensor(name: str, value, *, to_long: bool = False) -> torch.Tensor:
    """`value` if it is an integer-dtype tensor (bool is not), else `InputError` naming `name` and the dtype.

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.
        to_long: return it as int64 (e.g. uint8 ids, which the embedding refuses and whose range check would
            compare in uint8 and wrap).
    """
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor, got dtype {value.dtype} (shape {tuple(value.shape)})")
    return value.long() if to_long else value


def make_segments(
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    position_ids: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> Segments:
    """Validate `cu_seqlens` against a stream of `num_tokens` and derive per-token indices.

    `cu_seqlens` is host metadata: it is read once (one sync on an accelerator) and the per-token indices are
    built from it, so a stream on the `meta` device works with a CPU `cu_seqlens`.

    Args:
        cu_seqlens: int [N+1] cumulative sequence lengths.
        num_tokens: T, the length of the flat stream.
        position_ids: optional int [T] or [3, T] (MRoPE t/h/w); defaults to the offset within each sequence.
        device: where the per-token tensors live (default: `cu_seqlens`' device).

    Raises:
        InputError: a non-integer `cu_seqlens` / `position_ids`, a malformed `cu_seqlens`, or positions whose
            shape is not `[T]` / `[3, T]`.
    """
    integer_tensor("cu_seqlens", cu_seqlens)
    if position_ids is not None:
        integer_tensor("position_ids", position_ids)  # float positions would be floored silently
        if tuple(position_ids.shape) not in ((num_tokens,), (3, num_tokens)):
            raise InputError(
                f"position_ids must be [T] or [3, T] (MRoPE) with T={num_tokens}, got shape {tuple(position_ids.shape)}"
            )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise InputError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    cu_host = cu_seqlens.tolist()
    if cu_host[0] != 0 or cu_host[-1] != num_tokens:
        raise InputError(f"cu_seqlens must start at 0 and end at T={num_tokens}, got {cu_host[0]}..{cu_host[-1]}")
    lengths = [b - a for a, b in zip(cu_host[:-1], cu_host[1:], strict=True)]
    if any(n < 0 for n in lengths):
        raise InputError(f"cu_seqlens must be non-decreasing, got {cu_host}")
    device = torch.device(device) if device is not None else cu_seqlens.device
    lens_t = torch.tensor(lengths, dtype=torch.long)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lens_t, output_size=num_tokens)
    seq_start = torch.tensor(cu_host[:-1], dtype=torch.long)[seq_idx]
    seq_idx, seq_start = seq_idx.to(device), seq_start.to(device)
    pos_in_seq = torch.arange(num_tokens, device=device) - seq_start
    if position_ids is None:
        position_ids = pos_in_seq
    return Segments(
        cu_seqlens=torch.tensor(cu_host, dtype=torch.int32, device=device),
        position_ids=position_ids.long(),
        max_seqlen=max(lengths, default=0),
        seq_idx=seq_idx,
        seq_start=seq_start,
        lengths=lengths,
        cu_host=cu_host,
        pos_in_seq=pos_in_seq,
    )


def next_token_targets(labels: torch.Tensor, seg: Segments, ignore_index: int = -100) -> torch.Tensor:
    """Shift labels so token t predicts `labels[t + 1]`, never across a sequence boundary.

    Args:
        labels: int64 [T] labels of a flat stream (`ignore_index` marks tokens without loss).
        seg: the stream's `Segments`.
        ignore_index: value of positions without a target.

    Returns:
        int64 [T]: `labels[t + 1]` when t + 1 is in t's sequence, else `ignore_index` (each sequence's last token).
    """
    T = labels.shape[0]
    nxt = torch.full_like(labels, ignore_index)
    if T > 1:
        same_seq = seg.seq_idx[1:] == seg.seq_idx[:-1]
        nxt[:-1] = torch.where(same_seq, labels[1:], ignore_index)
    return nxt


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None):
    """Turn a padded `[B, S]` batch into a flat stream.

    Each row's real tokens must be contiguous (left or right padding). Positions default to the offset from each
    row's first real token. An empty batch (`B == 0`) is one empty sequence: `Segments` always has N >= 1.

    Args:
        input_ids: [B, S].
        attention_mask: [B, S] (nonzero = real token) or None (every token is real).
        position_ids: optional int [B, S] or [3, B, S] (MRoPE).

    Returns:
        flat_ids [T], segments, and `keep` (bool [B, S]) to scatter outputs back with `pad_back`.
    """
    if input_ids.dim() != 2:
        raise InputError(f"padded input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    if position_ids is not None and tuple(position_ids.shape) not in ((B, S), (3, B, S)):
        raise InputError(
            f"position_ids must be [B, S] or [3, B, S] (MRoPE) like input_ids {(B, S)}, "
            f"got shape {tuple(position_ids.shape)}"
        )
    if attention_mask is None:  # every token is real: a reshape (works on the meta device too)
        cu = torch.arange(B + 1, dtype=torch.int32) * S if B else torch.zeros(2, dtype=torch.int32)
        flat = input_ids.reshape(B * S)
        pos = None if position_ids is None else position_ids.reshape(*position_ids.shape[:-2], B * S)
        return flat, make_segments(cu, B * S, pos, device=input_ids.device), None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise InputError(f"attention_mask shape {got} != input_ids shape {tuple(input_ids.shape)}")
    keep = attention_mask.bool()
    lens = keep.sum(1)
    first = torch.where(keep.any(1), keep.float().argmax(1), torch.zeros_like(lens))
    span = torch.arange(S, device=keep.device)[None, :]
    contiguous = ((span >= first[:, None]) & (span < (first + lens)[:, None])) == keep
    if not bool(contiguous.all()):
        bad = int((~contiguous.all(1)).nonzero()[0])
        raise InputError(f"attention_mask row {bad} has holes; real tokens must be contiguous per row")
    cu = torch.zeros(max(B, 1) + 1, dtype=torch.int32, device=input_ids.device)
    cu[1 : B + 1] = torch.cumsum(lens, 0)
    flat = input_ids[keep]
    if position_ids is not None:
        pos = position_ids[..., keep] if position_ids.dim() == 3 else position_ids[keep]
    else:
        pos = None
    return flat, make_segments(cu, flat.shape[0], pos, device=input_ids.device), keep


def pad_back(flat: torch.Tensor, keep: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """Scatter a flat `[T, ...]` tensor back to `[B, S, ...]` (zeros at padding; `keep=None`: no padding)."""
    if keep is None:
        return flat.view(*shape, *flat.shape[1:])
    out = flat.new_zeros(*keep.shape, *flat.shape[1:])
    out[keep] = flat
    return out


@dataclass
class ModelInputs:
    """A forward's inputs as one checked flat stream (see `flatten_inputs`).

    Attributes:
        ids: int64 [T].
        seg: the stream's `Segments` (positions included).
        keep: bool [B, S] real tokens of a masked padded batch, else None.
        padded_shape: (B, S) for padded input, None for flat input.
        per_token: the per-token tensors passed to `flatten_inputs` (labels, ...), in flat order; None stays None.
    """

    ids: torch.Tensor
    seg: Segments
    keep: torch.Tensor | None
    padded_shape: tuple[int, int] | None
    per_token: dict[str, torch.Tensor | None]

    def pad_back(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token outputs `[T, ...]` in the caller's layout: `[B, S, ...]` for padded input, else unchanged."""
        return flat if self.padded_shape is None else pad_back(flat, self.keep, self.padded_shape)


def flatten_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **per_token: torch.Tensor | None,
) -> ModelInputs:
    """Check a model forward's inputs and turn them into one flat stream.

    Either padded `[B, S]` ids (+ optional `attention_mask`, positions `[B, S]` / `[3, B, S]`) or flat `[T]` ids
    (+ optional `cu_seqlens` `[N+1]`, default one sequence; positions `[T]` / `[3, T]`). Every per-token tensor
    (e.g. `labels=`) must have `input_ids`' shape and an integer dtype. An empty batch (`[0, S]` or `[0]`) is
    valid: its outputs are empty.

    Raises:
        InputError: naming the argument and its shape or dtype: non-integer ids / positions / cu_seqlens /
            per-token tensors, `cu_seqlens` with padded ids, an `attention_mask` with flat ids (it would be
            ignored), mismatched shapes, or a malformed `cu_seqlens` / mask.
    """
    ids = integer_tensor("input_ids", input_ids, to_long=True)
    for name, value in per_token.items():
        if value is not None:
            integer_tensor(name, value)
            if value.shape != ids.shape:
                raise InputError(f"{name} shape {tuple(value.shape)} != input_ids shape {tuple(ids.shape)}")
    if ids.dim() == 2:
        if cu_seqlens is not None:
            raise InputError(f"cu_seqlens is for flat [T] input_ids; got padded input_ids of shape {tuple(ids.shape)}")
        flat, seg, keep = unpad(ids, attention_mask, position_ids)
        flatten = (lambda t: t.reshape(-1)) if keep is None else (lambda t: t[keep])
        per = {n: None if t is None else flatten(t) for n, t in per_token.items()}
        return ModelInputs(flat, seg, keep, (ids.shape[0], ids.shape[1]), per)
    if ids.dim() != 1:
        raise InputError(f"input_ids must be [B, S] or flat [T], got shape {tuple(ids.shape)}")
    if attention_mask is not None:
        raise InputError(
            f"attention_mask is for padded [B, S] input_ids; flat input_ids {tuple(ids.shape)} mark their "
            "sequences with cu_seqlens (the mask would be ignored)"
        )
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, ids.shape[0]], dtype=torch.int32, device=ids.device)
    seg = make_segments(cu_seqlens, ids.shape[0], position_ids, device=ids.device)
    return ModelInputs(ids, seg, None, None, dict(per_token))


@dataclass
class PackedBatch:
    """One training micro-batch: sequences packed into a flat token stream.

    Attributes:
        input_ids: int64 [T].
        labels: int64 [T]; the token itself where it carries loss, -100 elsewhere (the loss shifts them).
        cu_seqlens: int32 [N+1], 0 first, last == T.
        position_ids: int64 [T], restarting at 0 at each sequence start, or [3, T] MRoPE positions (images).
        max_seqlen: longest sequence (host int).
        advantages: optional float [T] (RL).
        inference_logprobs: optional float [T] (RL).
        routed_experts: optional int64 [T, n_moe_layers, top_k] (router replay).
        pixel_values: optional float [sum t*h*w, P], the patches of every image in stream order.
        image_grid_thw: optional int64 [n_images, 3], each image's (t, h, w) in patches.
        mm_token_type_ids: optional int [T], 0 text / 1 image placeholder.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor
    max_seqlen: int
    advantages: torch.Tensor | None = None
    inference_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None

    def image_kwargs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The image fields that are set, moved to `device`, as keyword arguments of the composite model."""
        names = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
        return {n: getattr(self, n).to(device) for n in names if getattr(self, n) is not None}

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Host list of the N sequence lengths."""
        cu = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]

    @classmethod
    def from_sequences(cls, input_ids: list[list[int]], labels: list[list[int]]) -> PackedBatch:
        """Concatenate N sequences (host lists of ids and labels, pairwise equal lengths) into one stream."""
        lengths = [len(ids) for ids in input_ids]
        if [len(lab) for lab in labels] != lengths:
            raise InputError(f"labels lengths {[len(lab) for lab in labels]} != input_ids lengths {lengths}")
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(
            input_ids=torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int64),
            labels=torch.tensor([t for lab in labels for t in lab], dtype=torch.int64),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            position_ids=torch.tensor([p for n in lengths for p in range(n)], dtype=torch.int64),
            max_seqlen=max(lengths, default=0),
        )

    @classmethod
    def concat(cls, parts: list[PackedBatch]) -> PackedBatch:
        """Pack several packed batches into one stream (sequences, then images, in order).

        Optional per-token fields must be set on all parts or none; positions must have the same rank.
        """
        if not parts:
            raise InputError("PackedBatch.concat needs at least one batch")
        cu = [0]
        for b in parts:
            cu += [cu[-1] + n for n in b.lengths]

        def cat(name: str, dim: int = 0):
            values = [getattr(b, name) for b in parts]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise InputError(f"PackedBatch.concat: {name} is set on some batches but not all")
            return torch.cat(values, dim=dim)

        pos_dims = {b.position_ids.dim() for b in parts}
        if len(pos_dims) != 1:
            raise InputError(f"PackedBatch.concat: position_ids mix [T] and [3, T] layouts ({sorted(pos_dims)})")
        return cls(
            input_ids=cat("input_ids"),
            labels=cat("labels"),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32),
            position_ids=cat("position_ids", dim=-1),
            max_seqlen=max(b.max_seqlen for b in parts),
            advantages=cat("advantages"),
            inference_logprobs=cat("inference_logprobs"),
            routed_experts=cat("routed_experts"),
            pixel_values=cat("pixel_values"),
            image_grid_thw=cat("image_grid_thw"),
            mm_token_type_ids=cat("mm_token_type_ids"),
        )
