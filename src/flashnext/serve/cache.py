"""Fixed-capacity per-slot state of every layer, allocated once from the model's declarations.

The model declares what each stateful module keeps per sequence (`model.state_spec(max_model_len)`: per layer, a
typed record of `StateSpec`s by part; see `flashnext.model.state`). The cache allocates one buffer
`[max_slots + 1, *spec.shape]` per declared field, filled with the spec's empty-sequence value, and holds them in the
same record types, so a module reads its own state by field name and no shape is derived twice. Slots
`0 .. max_slots-1` belong to requests; the last one is a scratch slot that padding entries of a step read and write,
so padding never touches a request's state. Buffers are never reallocated or resized (shapes and storage addresses
fixed for the cache's life, as a captured CUDA graph needs); a step updates them in place.

For the tiny configs, e.g. a GDN layer holds `conv [S, K-1, conv_dim]` and `recurrent fp32 [S, Hv, Dk, Dv]`, a PLE
part `context int64 [S, ngram_size-1]` (EOS) and `conv [S, (K-1)*ngram_size, hc*D]`, a QSA layer `k, v [S, Lc, Hkv,
D]`, `raw_k [S, Lc, Di]`, `block_k [S, Lc/c, Di]` with Lc = (max_model_len // c + 1) * c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext.errors import InputError
from flashnext.model.state import POSITIONAL, RECURRENT, state_buffers


@dataclass
class Snapshot:
    """Copies of some slots' non-positional state (windows and recurrent states), by buffer, taken by
    `StateCache.snapshot`; `restore` writes them back. Positional state needs no copy: rows past a sequence's
    length are never read before they are written again."""

    slots: list[int]
    rows: list[tuple[torch.Tensor, torch.Tensor]]  # (cache buffer, its rows at `slots` when taken)


class StateCache:
    """Per-layer state buffers for `max_slots` sequences of up to `max_model_len` tokens, plus slot bookkeeping.

    Args:
        model: a model with `state_spec(max_len)` (`FlashNextForCausalLM` or the composite model).
        max_slots: concurrent sequences.
        max_model_len: longest sequence (prompt + generated tokens).
        dtype: dtype of activations kept (keys, values, conv windows); default the model's parameter dtype. States
            that declare a dtype (the GDN recurrent state: fp32; the n-gram context: int64) keep it.
        device: default the model's parameter device.
    """

    def __init__(self, model, max_slots: int, max_model_len: int, dtype=None, device=None):
        if max_slots < 1 or max_model_len < 1:
            raise InputError(f"max_slots={max_slots} and max_model_len={max_model_len} must be >= 1")
        param = next(model.parameters())
        dtype = param.dtype if dtype is None else dtype
        device = param.device if device is None else device
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.scratch_slot = max_slots
        S = max_slots + 1
        self.layers: list[dict] = []
        self._fills: list[tuple[torch.Tensor, int | float]] = []
        self._kinds: list[tuple[torch.Tensor, str]] = []
        for layer_spec in model.state_spec(max_model_len):
            parts = {}
            for name, spec in layer_spec.items():
                bufs = {}
                for field, s in state_buffers(spec).items():
                    buf = torch.full((S, *s.shape), s.fill, dtype=s.dtype or dtype, device=device)
                    self._fills.append((buf, s.fill))
                    self._kinds.append((buf, s.kind))
                    bufs[field] = buf
                parts[name] = type(spec)(**bufs)
            self.layers.append(parts)
        self._kind_of = {id(buf): kind for buf, kind in self._kinds}  # buffer -> its kind (`keep_prefix`)
        self._free = list(range(max_slots - 1, -1, -1))  # pop() hands out the lowest slot first

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
        """Set every buffer row of `slot` to its empty-sequence value (zeros; EOS for an n-gram context)."""
        for buf, fill in self._fills:
            buf[slot].fill_(fill)

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

    # ---- taking positions back ------------------------------------------------------------------------
    @torch.no_grad()
    def snapshot(self, slots: list[int], windows_only: bool = False) -> Snapshot:
        """Copy the window and recurrent state of `slots` (what a step overwrites and a rollback must restore);
        `windows_only`: the windows alone (a step keeping its per-position states: `keep_prefix` needs no more)."""
        idx = torch.tensor(slots, dtype=torch.long, device=self._fills[0][0].device)
        skip = (POSITIONAL, RECURRENT) if windows_only else (POSITIONAL,)
        rows = [(buf, buf.index_select(0, idx)) for buf, kind in self._kinds if kind not in skip]
        return Snapshot(list(slots), rows)

    @torch.no_grad()
    def restore(self, snap: Snapshot, slots: list[int] | None = None) -> None:
        """Put a snapshot's rows back: the slots' windows and recurrent states are as when it was taken.

        `slots`: only these of the snapshot's slots (default: all). Positional rows written since are left as they
        are (never visible below the restored length); the caller continues each slot from the length it had at
        the snapshot (or feeds the accepted tokens again).
        """
        slots = snap.slots if slots is None else slots
        pick = [snap.slots.index(s) for s in slots]  # raises ValueError for a slot the snapshot does not hold
        device = self._fills[0][0].device
        idx = torch.tensor(slots, dtype=torch.long, device=device)
        which = torch.tensor(pick, dtype=torch.long, device=device)
        for buf, rows in snap.rows:
            buf.index_copy_(0, idx, rows if pick == list(range(len(snap.slots))) else rows.index_select(0, which))

    @torch.no_grad()
    def keep_prefix(self, snap: Snapshot, kept: list, slot: int, entry: int, start: int, count: int) -> None:
        """After a verify step that kept per-position material (`StepBatch.kept`), set `slot`'s windows and recurrent
        states to what they were after its entry's first `count` fed tokens (the known ones and the accepted
        drafts): a recurrent state from the states per position, a window as the last rows of its rows in `snap`
        (before the step) followed by the first `count` rows the entry fed (from flat row `start`)."""
        at = snap.slots.index(slot)
        before = {id(buf): rows[at] for buf, rows in snap.rows}
        for buf, rows in kept:
            if self._kind_of[id(buf)] == RECURRENT:  # [L, N, ...] the states after each position
                buf[slot].copy_(rows[count - 1, entry])
            else:  # a window over a stream: [W, ...] rows before the step, then the fed ones
                stream = torch.cat([before[id(buf)], rows[start : start + count].to(buf.dtype)])
                buf[slot].copy_(stream[stream.shape[0] - buf.shape[1] :])

    # ---- inspection ----------------------------------------------------------------------------------
    def recurrent_bytes(self) -> int:
        """Bytes of one slot's recurrent states (every layer's)."""
        return sum(buf[0].numel() * buf.element_size() for buf, kind in self._kinds if kind == RECURRENT)

    def buffers(self) -> list[torch.Tensor]:
        """Every state tensor (for tests: compare states, check addresses never change)."""
        return [buf for buf, _ in self._fills]

    def kinds(self) -> list[tuple[torch.Tensor, str]]:
        """Every state tensor with its `StateSpec.kind` (window, recurrent, positional)."""
        return list(self._kinds)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
