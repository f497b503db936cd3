"""Denormal floats read and written as zero on the CPU threads that run torch's kernels (x86 FTZ and DAZ).

Why: a float below the smallest normal number (2^-126 ~ 1.2e-38 in fp32 and bf16) is denormal, and on x86 every
instruction that reads or yields one takes a slow microcode path (~100x for a matrix product whose terms are
denormal). A Gated DeltaNet chunk makes them by construction: its decays `exp(cum_i - cum_j)` and the products
built on them reach below 2^-126 wherever a head forgets quickly (random weights: 3-10% of a chunk's entries).
On a Xeon with AMX, 2 threads, the 31M benchmark model's 4096-token fwd+bwd ran 1.25x (fp32) and 1.54x (bf16)
faster with them flushed, a served 2048-token prefill 1.21x / 1.62x (`benchmarks/RESULTS.md`, stop 46). A flushed
value differs from the exact one by less than 2^-126 absolutely: nothing a float32 sum of normal terms can keep.

How: `torch.set_flush_denormal` sets the mode of the calling thread only, while torch's kernels (ATen's, MKL's,
oneDNN's, inductor's generated code) run on the calling thread's OpenMP team, whose worker threads keep the mode they
were started with (a new thread copies its creator's). `flush_denormals` therefore runs `torch.set_flush_denormal`
once on every thread of the team: through the OpenMP runtime's parallel-region entry (`GOMP_parallel`, exported by
GCC's libgomp, LLVM's libomp and Intel's libiomp5), called with `ctypes` on a Python callback. Call it after
`torch.set_num_threads`: a team that grows later reuses the idle threads of an earlier, larger team as they were
(new threads start from the caller's mode); threads another Python thread starts copy its mode. Where no OpenMP
runtime is found in the process (not Linux, or torch built on another thread pool), only the calling thread is set
and a warning says so.

The mode covers every float operation of those threads, Python's own too: a Python float below 2^-1022 (~2.2e-308)
reads as zero in arithmetic and comparisons on the calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

OPENMP_LIBRARIES = ("libgomp", "libomp", "libiomp5")  # file name prefixes of the runtimes with `GOMP_parallel`
_TEAM_ENTRY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (found in `/proc/self/maps`) with `GOMP_parallel`, else None; torch's
    own copy first where another one is loaded beside it (it is the one torch's kernels call). Looked up once: torch
    loads its runtime with itself."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    for path in sorted(paths, key=lambda p: (not p.startswith(torch_dir), p)):
        if os.path.basename(path).startswith(OPENMP_LIBRARIES):
            runtime = ctypes.CDLL(path)  # the copy already loaded: dlopen returns its handle
            if hasattr(runtime, "GOMP_parallel"):
                return runtime
    return None


def flush_denormals(on: bool = True) -> int:
    """Flush denormals to zero (`on`), or keep them (`on=False`: IEEE behaviour, torch's default), on the calling
    thread and every thread of its OpenMP team (`torch.get_num_threads()` threads).

    Returns:
        The number of threads set: the team's size; 1 where only the calling thread could be set (a warning); 0
        where the CPU has no such mode (nothing changed).
    """
    if not torch.set_flush_denormal(on):
        return 0
    runtime, threads = openmp_runtime(), torch.get_num_threads()
    if runtime is None or threads == 1:
        if threads > 1:
            log.warning("no OpenMP runtime found: denormals %s on the calling thread only", _mode(on))
        return 1
    seen: set[int] = set()
    lock = threading.Lock()

    def on_each_thread(_data) -> None:
        torch.set_flush_denormal(on)
        with lock:
            seen.add(threading.get_native_id())

    entry = _TEAM_ENTRY(on_each_thread)  # kept alive until the call returns
    runtime.GOMP_parallel(entry, None, ctypes.c_uint(threads), ctypes.c_uint(0))
    if len(seen) < threads:
        log.warning("denormals %s on %d of %d threads (the runtime gave a smaller team)", _mode(on), len(seen), threads)
    return len(seen)


def _mode(on: bool) -> str:
    return "flushed" if on else "kept"
