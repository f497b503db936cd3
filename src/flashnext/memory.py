"""Peak extra memory of a piece of work, measured by an allocation hook (`PeakBytes`).

A `TorchDispatchMode` sees every op run under it (re-entered inside DTensor ops, so their local ops are seen too).
It counts the storage bytes of each output whose storage is new (not an input's: a view or an in-place result
adds nothing), and a `weakref.finalize` on each tensor object returns the bytes when the last tensor on that
storage dies. Allocations inside a collective backend or inside a single kernel are not seen. Used by the RL
weight sync's statistics and the owner-routed embedding benchmark.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # e.g. an in-flight functional collective's output: seen again when waited on
        return 0


class PeakBytes(TorchDispatchMode):
    """Live bytes of storages created under the mode (`live`), and their peak (`peak`)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [tensor objects alive, bytes]

    def _release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[ptr]

    def _track(self, t: torch.Tensor, input_ptrs: set[int]) -> None:
        ptr = _storage_ptr(t)
        if ptr == 0:
            return
        if ptr in self.refs:
            self.refs[ptr][0] += 1
        elif ptr in input_ptrs:
            return  # a view of (or in-place result on) something that existed before
        else:
            self.refs[ptr] = [1, t.untyped_storage().nbytes()]
            self.live += self.refs[ptr][1]
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(x, DTensor) for x in leaves):
            return NotImplemented  # let DTensor run the op; its local ops then come back here
        input_ptrs = {_storage_ptr(x) for x in leaves if isinstance(x, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                self._track(t, input_ptrs)
        return out
