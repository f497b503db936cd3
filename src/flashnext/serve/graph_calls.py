"""How a compiled (CPU) or captured (CUDA) step graph of `serve.decode_graph` is called, step after step.

- `BoundStep`: a CPU graph called without dynamo once its guards passed (see `serve.decode_graph`'s "Bound calls").
- `CapturedStep`: a CUDA graph of the eager static step, replayed with its inputs copied in.
"""

from __future__ import annotations

import logging
import types

import torch

log = logging.getLogger("flashnext.serve")


class BoundStep:
    """One bucket's compiled graph function with the tensors its dynamo entry passes it, called without dynamo.

    `bind` runs the bucket's compiled entry that dynamo would choose for this step (the first whose guards pass;
    the bytecode dynamo generated: it gathers parameters, fused weights and cache buffers from their modules and
    calls the graph function) once, with the graph function swapped for a recorder in a copy of its globals; the
    recorded arguments, with the step's three inputs replaced, are what every later call passes. Not bindable
    (None, the bucket then stays on dynamo's path): no entry passing, or an entry doing more than calling one graph
    function and returning one of its outputs.
    """

    def __init__(self, graph, args: list, where: list[int], out: int, stamp: int):
        self.graph, self.args, self.where, self.out, self.stamp = graph, args, where, out, stamp

    def __call__(self, ids, slots, cached) -> torch.Tensor:
        args = self.args
        args[self.where[0]], args[self.where[1]], args[self.where[2]] = ids, slots, cached
        return self.graph(*args)[self.out]

    @staticmethod
    def bind(code: types.CodeType, owner, stamp: int, ids, slots, cached):
        """(the bound step or None, the logits of this step or None when it did not run). Dynamo's cache entries
        are read through private APIs: should they change, the bucket stays on dynamo's path (logged once a bucket)."""
        here = {"self": owner, "ids": ids, "slots": slots, "cached": cached}
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entry = next((e for e in _debug_get_cache_entry_list(code) if e.guard_manager.check(here)), None)
            names = [] if entry is None else [n for n in entry.code.co_names if n.startswith("__compiled_fn")]
            if len(names) != 1 or _stores(entry.code):
                return None, None
            glb = type(owner)._step.__globals__  # where dynamo keeps the step's compiled functions
            graph, seen = glb[names[0]], []
        except Exception:  # before the step ran: dynamo's path runs it
            log.warning("cannot bind the compiled decode step; it keeps going through dynamo", exc_info=True)
            return None, None

        def record(*args):
            seen.append((list(args), graph(*args)))
            return seen[-1][1]

        logits = types.FunctionType(entry.code, {**glb, names[0]: record})(owner, ids, slots, cached)
        args, outs = seen[0]
        where = [next((i for i, a in enumerate(args) if a is x), None) for x in (ids, slots, cached)]
        out = next((i for i, o in enumerate(outs) if o is logits), None)
        if len(seen) != 1 or None in where or out is None:
            return None, logits
        return BoundStep(graph, args, where, out, stamp), logits


def _stores(code: types.CodeType) -> bool:
    """Whether a dynamo entry writes anything but its own locals (an attribute, item or global: a side effect a
    bound call would skip)."""
    import dis

    writes = ("STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "DELETE_ATTR", "DELETE_SUBSCR")
    return any(i.opname in writes for i in dis.get_instructions(code))


class CapturedStep:
    """One bucket's decode step captured as a CUDA graph; inputs are copied into its fixed input tensors."""

    def __init__(self, fn, N: int, scratch_slot: int, device: torch.device, stamp: int):
        self.stamp = stamp
        self.ids = torch.zeros(N, dtype=torch.long, device=device)
        self.slots = torch.full((N,), scratch_slot, dtype=torch.long, device=device)
        self.cached = torch.zeros(N, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy initialisation and allocator warm-up outside the capture
            for _ in range(2):
                fn(self.ids, self.slots, self.cached)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(self.ids, self.slots, self.cached)

    def __call__(self, ids, slots, cached) -> torch.Tensor:
        self.ids.copy_(ids)
        self.slots.copy_(slots)
        self.cached.copy_(cached)
        self.graph.replay()
        return self.out
