"""How a family of step graphs (`DecodeGraph`'s buckets, `ChunkGraph`'s lengths) gets compiled: now (`warmup`) or in
a background thread while the engine runs those steps eager (`compile_in_background`). A mixin: the graph class
provides `buckets`, `ready`, `compile_seconds`, `background`, `cuda`, `NAME` / `UNIT` and `_call` (one step of a
size, compiling it on its first call)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from flashnext.errors import ConfigError

log = logging.getLogger("flashnext.serve")


class BackgroundCompile:
    """`warmup` / `compile_in_background` of a graph family (module doc)."""

    def warmup(self, buckets: Sequence[int] | None = None) -> dict[int, float]:
        """Compile (capture) the given buckets (default all) now, with steps of padding entries only (they touch
        only the scratch slot); returns the seconds each took."""
        for N in self.buckets if buckets is None else buckets:
            if N not in self.compile_seconds:
                self._warm(N)
        return dict(self.compile_seconds)

    def _warm(self, N: int) -> None:
        with torch.inference_mode():  # padding entries only: the scratch slot
            self._call(N, *self._inputs([], [], [], N))

    def compile_in_background(
        self,
        buckets: Sequence[int] | None = None,
        on_ready: Callable[[int, float], None] | None = None,
        then: Callable[[], object] | None = None,
    ) -> threading.Thread:
        """Compile the given buckets (default all, smallest first) in a daemon thread; returns it (started).

        Until a bucket is compiled, `ready_for` says False for its steps and the engine runs them eager; the
        thread marks a bucket ready only after its graph has run once (a padding-only step, on the scratch slot),
        so the engine never calls a graph that is still compiling. Each bucket has its own compiled code object
        (see `__init__`): the engine stepping a ready bucket and this thread compiling the next never share dynamo
        state. The thread does not refresh the fused weights (the engine's steps do, before every graph call), so a
        weight update is seen by the next engine step as ever. A bucket that fails to compile is logged and stays
        eager. `on_ready(bucket, seconds)` is called from the thread as each bucket switches to its graph, `then()` once
        every bucket is done (e.g. starting the prefill graphs' compile: one compile at a time on the CPU).

        On CUDA the capture needs the device to itself: do not call this there, use `warmup` (seconds).
        """
        if self.cuda:
            raise ConfigError("compile_in_background is for the CPU graph; on CUDA capture the buckets with warmup()")
        if self.background is not None:
            raise RuntimeError(f"the {self.NAME} graphs are already compiling in the background")
        todo = [N for N in (self.buckets if buckets is None else buckets) if N not in self.ready]
        threads = torch.get_num_threads()  # intra-op threads are per OS thread: the worker uses the caller's count
        self.background = threading.Thread(
            target=self._compile_all,
            args=(todo, threads, on_ready, then),
            name=f"flashnext-{self.NAME}-graph",
            daemon=True,
        )
        self.background.start()
        return self.background

    def _compile_all(self, todo: list[int], threads: int, on_ready, then) -> None:
        torch.set_num_threads(threads)
        start = time.perf_counter()
        for i, N in enumerate(todo, 1):
            t0 = time.perf_counter()
            try:
                self._warm(N)
            except Exception:  # the engine keeps running this bucket's steps eager
                log.exception("compiling the %s step for %s %d failed; its steps stay eager", self.NAME, self.UNIT, N)
                continue
            took = time.perf_counter() - t0
            log.info(
                "%s graph %d/%d (%s %d) compiled in %.1f s (%.1f s since start): its steps now run the graph",
                self.NAME, i, len(todo), self.UNIT, N, took, time.perf_counter() - start,
            )  # fmt: skip
            if on_ready is not None:
                on_ready(N, took)
        done = [N for N in todo if N in self.ready]
        log.info("%s graph: %d/%d compiled in %.1f s %s", self.NAME, len(done), len(todo),
                 time.perf_counter() - start, done)  # fmt: skip
        if then is not None:
            then()

    def compiling(self) -> list[int]:
        """Buckets not compiled yet (all of them before a compile started)."""
        return [N for N in self.buckets if N not in self.ready]
