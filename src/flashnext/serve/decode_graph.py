"""The compiled decode step: fixed-shape decode batches over the fixed-address state cache.

A decode-only step (every entry feeds one token to a sequence whose prompt is prefilled) is padded to the
smallest of a few size buckets (padding entries feed token 0 at row 0 of the cache's scratch slot) and run as a
static step (`model.state.make_decode_step`): its metadata are device tensors, every entry's state is written
(padding into the scratch slot), QSA blocks are planned on the device, so the step has no host sync and its
shapes depend on the bucket alone. Per bucket it is then
- on CPU, compiled with inductor (`torch.compile(fullgraph=True, dynamic=False)`: a graph break, i.e. a host
  read inside the step, is an error), once, at `warmup` or on the bucket's first step;
- on CUDA, captured as a CUDA graph (`torch.cuda.CUDAGraph`) of the eager static step, replayed with the step's
  ids / slots / positions copied into the captured input tensors.
Prefill (and any step holding a prompt chunk or an image prompt) stays on the engine's eager, chunked path.

Weights are never baked in. The compiled graphs read parameters and the fused serving weights
(`model.fused.Group`) as graph inputs, and `run` refreshes the fused weights on the host before each call (a
weight update in place, `load_state_dict`, or a trainer's weight sync is seen by the next step); inductor's
`freezing`, which would fold weights into constants, stays off. A captured CUDA graph reads every tensor at its
capture address: in-place updates are seen, and a parameter replaced by a new tensor (another address) makes
`run` capture that bucket again.

Recompiles: `compiles` counts the graphs compiled (one per bucket used); in steady state it does not grow (tested).

Legend: n real entries, N the bucket (n <= N), V vocab.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Sequence

import torch

from flashnext.errors import ConfigError
from flashnext.model import fused
from flashnext.model.state import make_decode_step

log = logging.getLogger("flashnext.serve")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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


def decode_only(plan) -> bool:
    """Whether an engine plan [(request, tokens)] is a decode-only step the graph can run: one token per request,
    every prompt prefilled, no MRoPE positions (an image prompt's blocks rotate at positions from its table), and no
    speculating request (its step verifies drafts riding along and needs the trunk's residual for its MTP head:
    `serve.speculative`'s eager path), and no request recording its routed experts (RL router replay: the graph
    returns logits only)."""
    return all(
        n == 1
        and req.num_cached >= len(req.prompt_ids)
        and req.mrope is None
        and not req.spec_k
        and not req.drafts
        and not req.params.return_routed_experts
        for req, n in plan
    )


class DecodeGraph:
    """The compiled (CPU) or captured (CUDA) decode step of a model over its state cache, one graph per bucket.

    Args:
        model: the prepared serving model (`prepare_for_inference`).
        cache: its `StateCache`.
        buckets: batch sizes to pad to (default `DEFAULT_BUCKETS`, capped at and ending with `cache.max_slots`).
        backend: torch.compile backend on CPU ("inductor"; "eager"/"aot_eager" trace without code generation).

    Raises:
        ConfigError: the model holds an n-gram table read from disk on the host (`--ngram-storage mmap`), which
            no graph can contain.
    """

    def __init__(self, model, cache, buckets: Sequence[int] | None = None, backend: str = "inductor"):
        from flashnext.checkpoint.ngram_ondisk import OnDiskNGramTable

        if any(isinstance(m, OnDiskNGramTable) for m in model.modules()):
            raise ConfigError(
                "the compiled decode step needs in-memory n-gram tables: --ngram-storage mmap reads rows from the "
                "checkpoint files on the host (use --decode-graph off, or another --ngram-storage)"
            )
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.buckets = bucket_sizes(buckets, cache.max_slots)
        self.groups = fused.groups(model)
        self.compiles = 0  # graphs handed to the compiler backend (one per bucket used, when nothing recompiles)
        self.compile_seconds: dict[int, float] = {}  # bucket -> wall time of its first (compiling) call
        self.cuda = self.device.type == "cuda"
        self._captured: dict[int, _CapturedStep] = {}
        self._compiled = None
        if not self.cuda:
            inner = torch._dynamo.lookup_backend(backend)

            def counting(gm, example_inputs):
                self.compiles += 1
                return inner(gm, example_inputs)

            # Dynamo keeps its compiled entries per code object: a private copy of `_step`'s code gives this instance
            # its own cache (one entry per bucket), gone with the instance, never shared with another engine's.
            step = types.FunctionType(DecodeGraph._step.__code__.replace(), globals(), "decode_step").__get__(self)
            self._compiled = torch.compile(
                step, backend=counting, fullgraph=True, dynamic=False, recompile_limit=len(self.buckets)
            )

    def _step(self, ids: torch.Tensor, slots: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        """The static decode step: ids, slots, cached int64 [N] -> logits [N, V] (padding rows included)."""
        step = make_decode_step(slots, cached, self.cache.scratch_slot)
        return self.model.forward_step(ids, step, self.cache)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n entries (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def run(self, ids: list[int], slots: list[int], cached: list[int]) -> torch.Tensor:
        """One decode step of n entries (token `ids[i]` into slot `slots[i]` after `cached[i]` tokens).

        Runs in inference mode whatever the caller's mode (the graphs are compiled for it: one mode, no
        recompile).

        Returns:
            logits [n, V] of the entries in order (the padding rows dropped; a view into the graph's output, valid
            until the next `run`).
        """
        with torch.inference_mode():
            return self._run(ids, slots, cached)

    def _run(self, ids: list[int], slots: list[int], cached: list[int]) -> torch.Tensor:
        n = len(ids)
        N = self.bucket(n)
        if N is None:
            raise ValueError(f"a decode step of {n} entries exceeds the largest bucket {self.buckets[-1]}")
        pad = N - n
        dev = self.device
        ids_t = torch.tensor(ids + [0] * pad, dtype=torch.long, device=dev)
        slots_t = torch.tensor(slots + [self.cache.scratch_slot] * pad, dtype=torch.long, device=dev)
        cached_t = torch.tensor(cached + [0] * pad, dtype=torch.long, device=dev)
        fused.refresh(self.groups)
        first = N not in self.compile_seconds
        start = time.perf_counter()
        if self.cuda:
            logits = self._replay(N, ids_t, slots_t, cached_t)
        else:
            logits = self._compiled(ids_t, slots_t, cached_t)
        if first:
            self.compile_seconds[N] = time.perf_counter() - start
            log.info("decode step for batch bucket %d ready in %.1f s", N, self.compile_seconds[N])
        return logits[:n]

    def warmup(self, buckets: Sequence[int] | None = None) -> dict[int, float]:
        """Compile (capture) the given buckets (default all) now, with steps of padding entries only (they touch
        only the scratch slot); returns the seconds each took."""
        for N in self.buckets if buckets is None else buckets:
            if N not in self.compile_seconds:
                self._warm(N)
        return dict(self.compile_seconds)

    def _warm(self, N: int) -> None:
        self.run([0] * N, [self.cache.scratch_slot] * N, [0] * N)  # padding entries only: the scratch slot

    def _replay(self, N: int, ids, slots, cached) -> torch.Tensor:
        """CUDA: replay bucket N's graph (captured first, or again if a parameter moved to a new address)."""
        stamp = _addresses(self.model)
        graph = self._captured.get(N)
        if graph is None or graph.stamp != stamp:
            graph = self._captured[N] = _CapturedStep(self._step, N, self.cache.scratch_slot, self.device, stamp)
            self.compiles += 1
        return graph(ids, slots, cached)


def _addresses(model) -> tuple:
    """Storage addresses of every parameter and buffer: what a captured graph has baked in."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


class _CapturedStep:
    """One bucket's decode step captured as a CUDA graph; inputs are copied into its fixed input tensors."""

    def __init__(self, fn, N: int, scratch_slot: int, device: torch.device, stamp: tuple):
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
