"""How a compiled (CPU) or captured (CUDA) step graph of `serve.decode_graph` is called, step after step.

- `BoundStep`: a CPU graph called without dynamo once its guards passed (see `serve.decode_graph`'s "Bound calls").
- `CapturedStep`: a CUDA graph of the eager static step, replayed with its inputs copied in.
"""

from __future__ import annotations

import contextlib
import logging
import threading
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
    function and returning one of its outputs (or a tuple of them: the step's result, rebuilt from the outputs).

    Deeper still (`_direct`): the graph function is AOTAutograd's runtime wrapper around inductor's compiled graph
    (`CompiledFxGraph`), whose C++ entry takes one handle per input. When the recorded call reached exactly one
    compiled graph with the step's inputs and output among its own, a bound call passes that graph's inputs to
    its entry directly and bumps the version counters the wrapper bumped (the inputs the graph mutates, as
    autograd sees them): ~60-90 us less a step (the wrapper layers, a list walk over ~170 inputs), measured on a
    batch-1 step of ~1.8 ms.
    """

    def __init__(self, fn, args: list, where: list[int], out: int | tuple, stamp: int, bumped: tuple = (),
                 direct: bool = False):  # fmt: skip
        self.fn, self.args, self.where, self.out, self.stamp, self.bumped = fn, args, where, out, stamp, bumped
        self.direct = direct  # calls go to inductor's compiled graph, not through AOTAutograd's wrapper

    def __call__(self, ids, slots, cached):
        """The step's result: one output of the graph, or a tuple of them (`out` an int, or a tuple of ints)."""
        args = self.args.copy()  # an entry may consume (clear) the list it is given
        args[self.where[0]], args[self.where[1]], args[self.where[2]] = ids, slots, cached
        outs = self.fn(args)
        if self.bumped:
            torch.autograd.graph.increment_version(self.bumped)
        return outs[self.out] if isinstance(self.out, int) else tuple(outs[i] for i in self.out)

    @staticmethod
    def bind(code: types.CodeType, owner, stamp: int, ids, slots, cached):
        """(the bound step or None, the result of this step or None when it did not run). Dynamo's cache entries
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
            tensors = list({id(a): a for a in args if _version(a) is not None}.values())
            before = list(map(_version, tensors))
            with _inner_calls() as inner:
                outs = graph(*args)
            bumps = [(a, a._version - v) for a, v in zip(tensors, before, strict=True)]
            bumped = tuple(a for a, n in bumps for _ in range(n))  # a tensor bumped twice is bumped twice again
            seen.append((list(args), outs, inner, bumped))
            return outs

        result = types.FunctionType(entry.code, {**glb, names[0]: record})(owner, ids, slots, cached)
        if len(seen) != 1:
            return None, result
        args, outs, inner, bumped = seen[0]
        direct = _direct(inner, (ids, slots, cached), result, bumped, stamp)
        if direct is not None:
            return direct, result
        where, out = _positions(args, (ids, slots, cached)), _result_positions(outs, result)
        if where is None or out is None:
            return None, result
        return BoundStep(lambda a: graph(*a), args, where, out, stamp), result


def _positions(items, wanted) -> list[int] | None:
    """The index of each of `wanted` in `items`, by identity (None when one is missing)."""
    at = [next((i for i, a in enumerate(items) if a is x), None) for x in wanted]
    return None if None in at else at


def _result_positions(outs, result) -> int | tuple | None:
    """Where a step's result sits among a graph's outputs: an index, a tuple of them for a tuple result, or None."""
    if not isinstance(outs, (list, tuple)):
        return None
    at = _positions(outs, result if isinstance(result, tuple) else (result,))
    return None if at is None else tuple(at) if isinstance(result, tuple) else at[0]


def _version(x):
    """A tensor's version counter (None: not a tensor, or an inference tensor, which has none)."""
    if not isinstance(x, torch.Tensor) or x.is_inference():
        return None
    return x._version


_HANDLE_FORM = {"torch", "Tensor", "isinstance", "tensor", "_C", "_aoti", "clear",
                "unsafe_alloc_void_ptrs_from_tensors", "alloc_tensors_by_stealing_from_void_ptrs"}  # fmt: skip


def _direct(calls: list, step_inputs: tuple, result, bumped: tuple, stamp: int) -> BoundStep | None:
    """From the compiled-graph calls one wrapped call made, a bound step calling inductor's compiled graph without
    AOTAutograd's runtime wrapper (see `BoundStep`): its C++ entry on handles of the inputs where its callable has
    the known handle-passing form, else the callable on the list. None: not exactly one call, or the step's inputs
    or its result not among that call's own."""
    if len(calls) != 1:
        return None
    compiled, args, outs = calls[0]
    fn = getattr(compiled, "current_callable", None)
    where, out = _positions(args, step_inputs), _result_positions(outs, result)
    if fn is None or where is None or out is None:
        return None
    entry = _entry(fn) if all(isinstance(a, torch.Tensor) for a in args) else None
    return BoundStep(entry or fn, args, where, out, stamp, bumped, direct=True)


def _entry(fn):
    """The C++ entry of inductor's compiled callable `fn` on a list of input tensors, or None where `fn` is not the
    known form (a closure over the entry `f` that converts inputs to handles, calls it, and takes its outputs)."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars != ("f",) or not set(code.co_names) <= _HANDLE_FORM:
        return None
    f = fn.__closure__[0].cell_contents
    alloc = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors
    steal = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs
    return lambda args: steal(f(alloc(args)))


_RECORDING = threading.Lock()


@contextlib.contextmanager
def _inner_calls():
    """Records (compiled graph, its inputs, its outputs) of every inductor graph this thread calls inside."""
    from torch._inductor.output_code import CompiledFxGraph

    calls, me = [], threading.get_ident()

    def recording(self, inputs):
        args = list(inputs)  # the entry clears the list it is given
        outs = call(self, inputs)
        if threading.get_ident() == me:
            calls.append((self, args, outs))
        return outs

    with _RECORDING:  # one recorder installed at a time (a bind in another thread waits)
        call = CompiledFxGraph.__call__
        CompiledFxGraph.__call__ = recording
        try:
            yield calls
        finally:
            CompiledFxGraph.__call__ = call


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
