"""The compiled decode step: fixed-shape decode batches over the fixed-address state cache.

A decode-only step (every entry feeds one token to a sequence whose prompt is prefilled) is padded to the
smallest of a few size buckets (padding entries feed token 0 at row 0 of the cache's scratch slot) and run as a
static step (`model.state.make_decode_step`): its metadata are device tensors, every entry's state is written
(padding into the scratch slot), QSA blocks are planned on the device, so the step has no host sync and its
shapes depend on the bucket alone. Per bucket it is then
- on CPU, compiled with inductor (`torch.compile(fullgraph=True, dynamic=False)`: a graph break, i.e. a host
  read inside the step, is an error), once, at `warmup`, on the bucket's first step, or in a background thread
  (`compile_in_background`, what `serve` does: the engine runs a bucket's steps eager until its graph is
  compiled, then switches; compiled graphs persist in inductor's disk cache, `use_compile_cache`);
- on CUDA, captured as a CUDA graph (`torch.cuda.CUDAGraph`) of the eager static step, replayed with the step's
  ids / slots / positions copied into the captured input tensors.
Prefill (and any step holding a prompt chunk or an image prompt) stays on the engine's eager, chunked path.

Weights are not baked in (unless frozen, below). The compiled graphs read parameters and the fused serving weights
(`model.fused.Group`) as graph inputs, and `run` refreshes the fused weights on the host before each call (a
weight update in place, `load_state_dict`, or a trainer's weight sync is seen by the next step); inductor's
`freezing`, which would fold weights into constants, stays off. A captured CUDA graph reads every tensor at its
capture address: in-place updates are seen, and a parameter replaced by a new tensor (another address) makes
`run` capture that bucket again.

Frozen weights (`frozen=True`, CPU; `serve --freeze-weights`): the graphs of 2+ rows (`_freezes`; 1 row too for
16-bit weights the CPU has instructions for) are compiled with inductor's `freezing` (the parameters and fused
weights become constants of the graph, packed for its C++ GEMM template, which its `max_autotune` times against
aten's kernels per product: `FROZEN_PATCHES`; the products are traced as `F.linear`, `fused.frozen_products`). Bench
config, 2 threads, one process alternating: the batch-16 step 11.0 -> 9.3-9.4 ms in fp32, 12.5 -> 11.1 in bf16
(AVX2); batch 4 5.5 -> 4.5 (fp32). The price: weights can no longer change under the graphs, and each graph holds
its own packed copy of the weights (memory).
`versioned` then covers every parameter and buffer, and a change after a graph was compiled (in place, or a tensor
replaced) retires the graphs (`thawed`: logged once; every later step runs eager, exact with the new weights);
the engine refuses weight updates outright (`Engine.load_weights`, the admin update routes). Quantized models are
refused (their codes would fold into fp32 constants). inductor's `freezing` is a process-wide setting that dynamo
reads while tracing: it is held on, counted across threads, while a frozen graph's step is traced
(`serve.frozen.freezing`); another model compiled at that very moment in another thread would see it too.

Guards: only the tensor guards are kept (`torch.compiler.keep_tensor_guards_unsafe`: the inputs' and parameters'
dtypes, shapes and strides). The guards on module attributes and globals are dropped: at batch 1 they were ~10% of
a step (1-thread CPU time 5.35 -> 4.82 ms), and the contract of a serving model makes them redundant: its
structure and Python attributes (config, layer kinds, `fused` constants) are fixed once the engine is built,
weights change only in place (`serve/weight_update.py`, `fused.Group.build`), and parameters are read at call time
anyway. A Python value the step reads is baked into the graph: change it and build a new engine (tested).

Bound calls (CPU): once a bucket's graph has run through dynamo (its guards checked) and the layout is unchanged,
its steps skip dynamo altogether. `BoundStep` runs the bucket's one compiled entry once with its graph function
swapped for a recorder, keeps the tensors it passed (parameters, fused weights, cache buffers: read in place, as a
CUDA graph reads them at their addresses) and from then on calls the graph function on them with the step's ids /
slots / positions: no frame evaluation, no guards, no attribute walk (-0.65 ms of a ~2.8 ms batch-1 step, 1-thread
CPU time); where it can, inductor's C++ entry itself, past AOTAutograd's runtime wrapper (-60 us more). The layout
check (`_Layout`: every parameter's and buffer's object and storage address, before each step) stands in for the
guards: a tensor replaced by another (`load_state_dict(assign=True)`, `p.data = ...`, a new `nn.Parameter`) sends
the next step through dynamo again (which recompiles if the new tensor's dtype, shape or strides differ), and the
step after it binds anew. In-place updates (the weight-update and fused rebuild contract) keep addresses and are
seen by the bound call.

Recompiles: `compiles` counts the graphs compiled (one per bucket used); in steady state it does not grow (tested).

Legend: n real entries, N the bucket (n <= N), V vocab.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import os
import threading
import time
import types
from collections.abc import Callable, Sequence

import torch

from flashnext.errors import ConfigError
from flashnext.model import fused
from flashnext.model.state import make_decode_step
from flashnext.ops import grouped_experts
from flashnext.serve.frozen import FROZEN_PATCHES, check_freezable, freezing
from flashnext.serve.graph_calls import BoundStep, CapturedStep
from flashnext.serve.graph_compile import BackgroundCompile
from flashnext.serve.sampling import attach_maxima, greedy_of

log = logging.getLogger("flashnext.serve")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_COMPILE_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "flashnext", "inductor")
# Inductor settings of the CPU decode graphs: the generated C++ wrapper instead of the Python one (-8% of a batch-1
# step's CPU time: the wrapper's per-step buffer and kernel calls; compiling takes ~45% longer), no size/alignment
# asserts on the extern kernels' outputs (-4% with the Python wrapper), and bf16 rounded where the eager step rounds
# (inductor otherwise keeps fused intermediates in fp32: a bf16 graph would drift from the eager engine and from the
# trainer's forward by more than summation order).
INDUCTOR_PATCHES = {
    "cpp_wrapper": True, "size_asserts": False, "alignment_asserts": False, "emulate_precision_casts": True,
}  # fmt: skip
RECOMPILES_PER_BUCKET = 2  # a parameter replaced by a tensor of another kind may recompile a bucket once


def bucket_sizes(buckets: Sequence[int] | None, max_slots: int) -> list[int]:
    """The sorted bucket sizes up to `max_slots`, with `max_slots` itself when larger than every bucket.

    Raises:
        ConfigError: a bucket size that is not a positive int.
    """
    chosen = DEFAULT_BUCKETS if buckets is None else buckets
    bad = [b for b in chosen if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ConfigError(f"decode bucket sizes must be positive ints, got {bad[0]!r} in {list(chosen)}")
    sizes = sorted({b for b in chosen if b <= max_slots})
    if not sizes or sizes[-1] < max_slots:
        sizes.append(max_slots)  # every decode batch fits some bucket
    return sizes


def use_compile_cache(path: str | None = None) -> str:
    """Point inductor's on-disk cache (compiled graphs: its FX graph and AOTAutograd caches, both on by default) at
    `path`, else at `$TORCHINDUCTOR_CACHE_DIR` when set, else at `DEFAULT_COMPILE_CACHE` (which survives reboots,
    unlike inductor's own default under /tmp); returns the directory. Call it before the first compile: inductor
    reads the variable when it first looks up its cache.
    """
    chosen = path or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.expanduser(DEFAULT_COMPILE_CACHE)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen = os.path.abspath(os.path.expanduser(chosen))
    return chosen


def decode_only(plan) -> bool:
    """Whether an engine plan [(request, tokens)] is a decode-only step the graph can run: one token per request,
    every prompt prefilled, and every request `plain`."""
    return all(n == 1 and req.num_cached >= len(req.prompt_ids) and plain(req) for req, n in plan)


def plain(req) -> bool:
    """Whether a request's step can run as a compiled graph, which returns logits only: no MRoPE positions (an
    image prompt's blocks rotate at positions from its table), no speculation (its step verifies drafts riding
    along and needs the trunk's residual for its MTP head: `serve.speculative`'s eager path), and no routing record
    (RL router replay)."""
    return req.mrope is None and not req.spec_k and not req.drafts and not req.params.return_routed_experts


class DecodeGraph(BackgroundCompile):
    """The compiled (CPU) or captured (CUDA) decode step of a model over its state cache, one graph per bucket.

    Args:
        model: the prepared serving model (`prepare_for_inference`).
        cache: its `StateCache`.
        buckets: batch sizes to pad to (default `DEFAULT_BUCKETS`, capped at and ending with `cache.max_slots`).
        backend: torch.compile backend on CPU ("inductor"; "eager"/"aot_eager" trace without code generation).
        frozen: compile with the weights frozen into the graphs (CPU; module doc).

    Raises:
        ConfigError: the model holds an n-gram table read from disk on the host (`--ngram-storage mmap`), which
            no graph can contain; `frozen` on CUDA or with a quantized model.
    """

    NAME, UNIT = "decode", "batch"  # what the logs call the graphs and their sizes

    def __init__(
        self, model, cache, buckets: Sequence[int] | None = None, backend: str = "inductor", frozen: bool = False
    ):
        from flashnext.ngram import NgramTable

        if any(isinstance(m, NgramTable) and m.storage == "mmap" for m in model.modules()):
            raise ConfigError(
                "the compiled decode step needs in-memory n-gram tables: --ngram-storage mmap reads rows from the "
                "checkpoint files on the host (use --decode-graph off, or another --ngram-storage)"
            )
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            grouped_experts.available()  # the routed experts' kernel, built (once) before any trace reads it
        self.frozen = frozen and check_freezable(model, self.device)
        self.weight_dtype = next((p.dtype for p in model.parameters() if p.dim() == 2), None)  # `_freezes`
        self.thawed = False  # frozen graphs retired: the weights changed after they were compiled
        self._checked_now = False  # `ready_for` has just run the layout check (frozen graphs)
        self.buckets = self._sizes(buckets, cache.max_slots)
        self.watch = fused.Watch(fused.groups(model))  # the fused weights' change check before each call
        self.compiles = 0  # graphs handed to the compiler backend (one per bucket used, when nothing recompiles)
        self.compile_seconds: dict[int, float] = {}  # bucket -> wall time of its first (compiling) call
        self.cuda = self.device.type == "cuda"
        self.ready: set[int] = set()  # buckets whose graph is compiled (captured) and has run once
        self.background: threading.Thread | None = None  # the thread compiling buckets (`compile_in_background`)
        members = [(d, n) for d, n in self.watch.slots if d.get(n) is not None]  # the fused groups' parameters
        if self.frozen:  # every weight is baked into the graphs: every one versioned
            members = None
        self.layout = _Layout(model, members)  # every parameter and buffer, checked before each step (module doc)
        self.layout.check()  # the layout graphs are compiled (captured) in, also by `warmup` and the background
        self._captured: dict[int, CapturedStep] = {}
        self._compiled: dict[int, Callable] = {}
        self._codes: dict[int, types.CodeType] = {}  # bucket -> its private copy of `_step`'s code (dynamo's key)
        self._bound: dict[int, BoundStep | None] = {}  # bucket -> its bound call (None: it cannot be bound)
        self._checked: dict[int, int] = {}  # bucket -> layout generation of its last call through dynamo's guards
        self._host: dict[int, tuple] = {}  # bucket -> its input tensors and their numpy views (CPU, `_inputs`)
        if not self.cuda:
            # Dynamo keeps its compiled entries per code object: a private copy of `_step`'s code per bucket gives
            # each bucket its own cache entry, gone with the instance, never shared with another engine's or
            # another bucket's (a bucket compiling in the background never touches the entry the engine is using).
            for N in self.buckets:
                name = f"{self.NAME}_step_{N}"
                code = self._codes[N] = type(self)._step.__code__.replace(co_name=name)
                step = types.FunctionType(code, type(self)._step.__globals__, name).__get__(self)
                self._compiled[N] = torch.compile(
                    step, backend=self._backend(backend, self._freezes(N)), fullgraph=True, dynamic=False,
                    recompile_limit=RECOMPILES_PER_BUCKET,
                    options={"guard_filter_fn": _tensor_guards},  # see the module doc
                )  # fmt: skip

    def _backend(self, name: str, frozen: bool) -> Callable:
        """The compiler backend of one size's graph: inductor with `INDUCTOR_PATCHES` (and `FROZEN_PATCHES`), or
        the named backend; counting the graphs compiled."""
        inner = torch._dynamo.lookup_backend(name)
        if name == "inductor":
            from torch._inductor.compile_fx import compile_fx

            patches = {**INDUCTOR_PATCHES, **(FROZEN_PATCHES if frozen else {})}
            inner = functools.partial(compile_fx, config_patches=patches)

        def counting(gm, example_inputs):
            self.compiles += 1
            return inner(gm, example_inputs)

        return counting

    def _freezes(self, N: int) -> bool:
        """Whether size N's graph holds the weights frozen: with `frozen`, from 2 rows, and at one row for 16-bit
        weights the CPU has instructions for (`fused.frozen_native`: their products are the template's). Otherwise
        one row gains nothing: its products are reductions reading the weights as they lie, and folded, a 16-bit
        weight's upcast is what they would read (twice the bytes: bench config, bf16 batch-1 step on an AVX2 CPU
        1.80 -> 2.23 ms); fp32 on a Xeon with AMX, one process: 1.000 -> 1.023 the time."""
        return self.frozen and (N > 1 or fused.NATIVE_GEMM.get(self.weight_dtype, False))

    @staticmethod
    def _sizes(buckets: Sequence[int] | None, max_slots: int) -> list[int]:
        return bucket_sizes(buckets, max_slots)

    def _step(self, ids: torch.Tensor, slots: torch.Tensor, cached: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The static decode step: ids, slots, cached int64 [N] -> logits [N, V] (padding rows included), their
        row maxima and first indices [N] (for greedy sampling: `serve.sampling.attach_maxima`)."""
        step = make_decode_step(slots, cached, self.cache.scratch_slot)
        logits = self.model.forward_step(ids, step, self.cache)
        return logits, *logits.max(-1)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n entries (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def ready_for(self, n: int) -> bool:
        """Whether a decode step of n entries should run as the graph now. While `compile_in_background` runs,
        only once its bucket is compiled (until then the engine runs the step eager); otherwise always (a bucket
        not compiled yet compiles on its first step)."""
        N = self.bucket(n)
        checked = self._retire_if_changed()
        ready = N is not None and not self.thawed and (self.background is None or N in self.ready)
        self._checked_now = checked and ready  # `run` next (same thread) need not read the layout again
        return ready

    def _retire_if_changed(self) -> bool:
        """Frozen graphs in use: the layout check now, before the step is planned (weights changed since the
        compile retire them); whether it ran."""
        if not (self.frozen and not self.thawed and self.compile_seconds):
            return False
        self._changed()
        return True

    def run(self, ids: list[int], slots: list[int], cached: list[int]) -> torch.Tensor:
        """One decode step of n entries (token `ids[i]` into slot `slots[i]` after `cached[i]` tokens).

        Runs in inference mode whatever the caller's mode (the graphs are compiled for it: one mode, no
        recompile).

        Returns:
            logits [n, V] of the entries in order (the padding rows dropped; a view into the graph's output, valid
            until the next `run`).

        Raises:
            RuntimeError: the bucket is still being compiled in the background (ask `ready_for` first).
        """
        with torch.inference_mode():
            return self._run(ids, slots, cached)

    def run_greedy(self, ids: list[int], slots: list[int], cached: list[int], steps: int) -> tuple[list, torch.Tensor]:
        """Up to `steps` decode steps of the n entries, each fed the greedy tokens of the one before
        (`serve.decode_runs`): (every step's greedy tokens but the last's, as host lists; the last step's logits, as
        `run`'s). A step whose row maxima are not all finite ends the run: its logits come back as the last, for
        the sampler to fail those rows. The layout is checked before the first step only (weights change between
        engine steps)."""
        with torch.inference_mode():
            tokens: list[list[int]] = []
            while True:
                logits = self._run(ids, slots, cached)
                maxes, greedy = greedy_of(logits)
                if len(tokens) == steps - 1 or not all(math.isfinite(m) for m in maxes.tolist()):
                    return tokens, logits
                ids = greedy.tolist()
                tokens.append(ids)
                cached = [c + 1 for c in cached]
                self._checked_now = True  # the layout was checked before the first step of the run

    def _run(self, ids: list[int], slots: list[int], cached: list[int]) -> torch.Tensor:
        n = len(ids)
        N = self.bucket(n)
        if N is None:
            raise ValueError(f"a decode step of {n} entries exceeds the largest bucket {self.buckets[-1]}")
        if self.background is not None and N not in self.ready:
            raise RuntimeError(f"decode bucket {N} is still compiling in the background; run this step eager")
        if not self._checked_now:
            self._changed()
        self._checked_now = False
        if self.thawed:
            raise RuntimeError(f"the frozen {self.NAME} graphs were retired (the weights changed): run this step eager")
        logits, maxes, tokens = self._call(N, *self._inputs(ids, slots, cached, N))
        return attach_maxima(logits[:n], maxes[:n], tokens[:n])

    def _changed(self) -> None:
        """The layout check before a step: weights changed since the last step are seen by this one (the fused
        weights rebuilt); frozen graphs compiled before the change are retired instead (module doc)."""
        if not self.layout.check():
            return
        self.watch.refresh()
        if not self.frozen or not self.compile_seconds or self.thawed:
            return
        self.thawed = True
        log.warning(
            "the model's weights changed after its %s graphs were compiled with them frozen (freeze_weights): "
            "those graphs are retired and its steps run eager from now on; build a new engine to compile again",
            self.NAME,
        )

    def _inputs(self, ids: list[int], slots: list[int], cached: list[int], N: int) -> tuple[torch.Tensor, ...]:
        """ids, slots, cached padded to N entries (padding: token 0 at row 0 of the scratch slot), on the device.
        On the CPU written into bucket N's own three tensors through numpy views (~5 us against ~30 us for three
        new tensors): a step has read them before the next step writes them, and no step keeps them."""
        pad, dev, n = N - len(ids), self.device, len(ids)
        if self.cuda:
            return (
                torch.tensor(ids + [0] * pad, dtype=torch.long, device=dev),
                torch.tensor(slots + [self.cache.scratch_slot] * pad, dtype=torch.long, device=dev),
                torch.tensor(cached + [0] * pad, dtype=torch.long, device=dev),
            )
        if N not in self._host:
            tensors = tuple(torch.zeros(N, dtype=torch.long) for _ in range(3))
            self._host[N] = tensors, tuple(t.numpy() for t in tensors)
        tensors, (a_ids, a_slots, a_cached) = self._host[N]
        a_ids[:n], a_slots[:n], a_cached[:n] = ids, slots, cached
        a_ids[n:], a_slots[n:], a_cached[n:] = 0, self.cache.scratch_slot, 0
        return tensors

    def _call(self, N: int, ids_t, slots_t, cached_t):
        """Bucket N's graph on padded inputs (what `_step` returns); its first call compiles (captures) it, timed (and
        logged, unless the background thread compiles it: that logs its own progress line)."""
        first = N not in self.compile_seconds
        start = time.perf_counter()
        out = self._replay(N, ids_t, slots_t, cached_t) if self.cuda else self._cpu(N, ids_t, slots_t, cached_t)
        if first:
            self.compile_seconds[N] = time.perf_counter() - start
            self.ready.add(N)
            if threading.current_thread() is not self.background:
                log.info("%s step for %s %d ready in %.1f s", self.NAME, self.UNIT, N, self.compile_seconds[N])
        return out

    def _cpu(self, N: int, ids, slots, cached):
        """CPU: bucket N's graph, bound (see the module doc) when the layout is the one its guards last passed."""
        stamp = self.layout.generation
        bound = self._bound.get(N)
        if bound is not None and bound.stamp == stamp:
            return bound(ids, slots, cached)
        tracing = freezing() if self._freezes(N) else contextlib.nullcontext()
        if self._checked.get(N) == stamp and (N not in self._bound or bound is not None):
            with tracing:
                bound, out = BoundStep.bind(self._codes[N], self, stamp, ids, slots, cached)
            self._bound[N] = bound
            if out is not None:
                return out
        with tracing:
            out = self._compiled[N](ids, slots, cached)
        self._checked[N] = stamp
        return out

    def bound(self) -> list[int]:
        """Buckets whose steps now skip dynamo (CPU)."""
        return sorted(N for N, b in self._bound.items() if b is not None)

    def _replay(self, N: int, ids, slots, cached):
        """CUDA: replay bucket N's graph (captured first, or again if a parameter moved to a new address)."""
        stamp = self.layout.generation
        graph = self._captured.get(N)
        if graph is None or graph.stamp != stamp:
            graph = self._captured[N] = CapturedStep(self._step, N, self.cache.scratch_slot, self.device, stamp)
            self.compiles += 1
        return graph(ids, slots, cached)


def _tensor_guards(entries) -> list[bool]:
    """Dynamo's guard filter for the decode graphs: keep the guards on tensors (parameters included), drop the rest."""
    return torch.compiler.keep_tensor_guards_unsafe(entries, keep_parameters=True)


_VERSION = operator.attrgetter("_version")
_REGISTRATIONS = [0]  # parameters and buffers (re)registered on any module since `_count_registrations` ran
_HOOKS: list = []


def _count_registrations() -> None:
    """Count every parameter / buffer registration in the process (a module attribute set to a new tensor,
    `load_state_dict(assign=True)`, ...) from now on; once per process."""
    if not _HOOKS:
        from torch.nn.modules import module

        def count(mod, name, value):
            _REGISTRATIONS[0] += 1

        _HOOKS.extend([module.register_module_parameter_registration_hook(count),
                       module.register_module_buffer_registration_hook(count)])  # fmt: skip


class _Layout:
    """Every parameter and buffer of a model, checked before each step (`check`). `generation` counts layout
    changes, a tensor replaced by another object or its storage moved: what a captured CUDA graph and a bound CPU
    step have baked in. `check` also says whether a `versioned` parameter (the fused groups' members) changed in
    place, so the fused weights' own check (`fused.Watch`) runs only then.

    Cost: right after a decode graph has streamed the weights, every object the check touches is a cache miss (a
    check of the 31M model's 207 tensors took 270 us there against 40 us warm). So a step reads only the held
    tensors' addresses and the members' versions (~170 us cold); the modules' slots are read again (a replaced
    tensor) only after a parameter or buffer registration anywhere in the process (`_count_registrations`)."""

    def __init__(self, model, versioned: list[tuple[dict, str]] | None):
        _count_registrations()
        held = [(d, n) for m in model.modules() for d in (m._parameters, m._buffers) for n in d if d[n] is not None]
        versioned = held if versioned is None else versioned  # None: every parameter and buffer
        self._slots = ([d for d, _ in held], [n for _, n in held])
        self._versioned_slots = ([d for d, _ in versioned], [n for _, n in versioned])
        self._registrations = -1  # `_REGISTRATIONS` when the slots were last read
        self._seen: tuple | None = None  # (tensors, versioned tensors, addresses, versions) at the last check
        self.generation = 0

    def check(self) -> bool:
        """Whether anything changed since the last check (a tensor replaced, moved, or a versioned parameter
        updated in place); bumps `generation` when the layout did."""
        seen = self._seen
        if seen is None or self._registrations != _REGISTRATIONS[0]:
            return self._reread()
        try:
            addresses = list(map(torch.Tensor.data_ptr, seen[0]))
            versions = list(map(_VERSION, seen[1]))
        except RuntimeError:
            return self._reread()
        if addresses != seen[2]:
            self.generation += 1
        elif versions == seen[3]:
            return False
        self._seen = (seen[0], seen[1], addresses, versions)
        return True

    def _reread(self) -> bool:
        self._registrations = _REGISTRATIONS[0]
        tensors = list(map(dict.get, *self._slots))
        versioned = list(map(dict.get, *self._versioned_slots))
        seen, self._seen = self._seen, None
        try:
            addresses = list(map(torch.Tensor.data_ptr, tensors))
            self._seen = (tensors, versioned, addresses, list(map(_VERSION, versioned)))
        except (TypeError, RuntimeError):  # a slot emptied, or a member without a version counter: always changed
            pass
        if self._seen is None or seen is None or not all(map(operator.is_, tensors, seen[0])) or addresses != seen[2]:
            self.generation += 1
            return True
        return self._seen[3] != seen[3]  # re-read after a registration elsewhere: only versions may have moved
