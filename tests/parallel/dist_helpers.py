"""Run a function on every rank of a fresh gloo group on 127.0.0.1, in spawned processes, with timeouts.

Imported by module name (`from dist_helpers import run_spawned`): pytest puts this test folder on `sys.path`, and
spawned children inherit it, so functions defined in the test modules can be the per-rank target.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue as queue_mod
import shutil
import socket
import sys
import time
import traceback
import warnings

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30  # a collective that waits longer fails instead of hanging the suite


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank: int, world_size: int, port: int, args: tuple, results) -> None:
    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a signal prints its Python stack on stderr (pytest shows it)
    torch.set_num_threads(1)  # world_size processes share the CI box's few cores
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback whatever the hostname resolves to
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            # Plain pickle bytes: a queued tensor would travel as shared memory that dies with this process.
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


class RankKilled(RuntimeError):
    """A rank ended by a signal (a native crash: its Python stack is on stderr) before it answered."""


def run_spawned(fn, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """`[fn(rank, world_size, *args) for rank]`, each run in its own spawned process inside one gloo group.

    `fn` must be importable by module name and return something picklable. Raises `RuntimeError` with every
    failing rank's traceback, or when the ranks have not all answered within `timeout_s` (they are then killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    answers: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                answers[rank] = (status, value)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(answers))
                    raise RuntimeError(f"ranks {missing} of {world_size} did not answer within {timeout_s}s") from None
                if any(not p.is_alive() and p.exitcode != 0 for p in procs) and results.empty():
                    codes = [p.exitcode for p in procs]
                    died = RankKilled if any(c is not None and c < 0 for c in codes) else RuntimeError
                    raise died(f"a rank died without answering; exit codes {codes}") from None
    finally:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(answers.items()) if s != "ok"]
    if errors:
        raise RuntimeError("spawned ranks failed:\n" + "\n".join(errors))
    return [pickle.loads(answers[r][1]) for r in range(world_size)]


def spawned_once(cache: dict, key, fn, world_size: int, *args, timeout_s: float = 120.0, fresh_dir=None) -> list:
    """`run_spawned(fn, world_size, *args)` once per `key` of a module's `cache`, for the tests that share one run.

    A failed run is remembered too: the later tests report its cause in one line instead of running again into the
    directories the first attempt left half-written (a second failure that would hide the first one's cause).
    `fresh_dir`: a directory only this run writes. When a rank was killed by a signal (a native crash in torch or
    gloo: seen once, in CI's training matrix, not reproduced in 11 local runs; its stack is on stderr), the directory
    is emptied and the run made once more, with a warning naming the crash. Any other failure is not run again.
    """
    if key not in cache:
        try:
            cache[key] = _rerun_if_killed(key, fn, world_size, args, timeout_s, fresh_dir)
        except RuntimeError as e:
            cache[key] = e
            raise
    got = cache[key]
    if isinstance(got, RuntimeError):
        first = str(got)[:500]
        raise RuntimeError(f"the shared spawned run {key!r} failed (reported in full by an earlier test): {first}")
    return got


def _rerun_if_killed(key, fn, world_size: int, args: tuple, timeout_s: float, fresh_dir) -> list:
    """`run_spawned`, made once more in the emptied `fresh_dir` when a rank was killed by a signal (`spawned_once`)."""
    try:
        return run_spawned(fn, world_size, *args, timeout_s=timeout_s)
    except RankKilled as e:
        if fresh_dir is None:
            raise
        warnings.warn(f"spawned run {key!r}: {e}; emptied {fresh_dir} and ran it again", stacklevel=3)
    shutil.rmtree(fresh_dir, ignore_errors=True)
    os.makedirs(fresh_dir)
    return run_spawned(fn, world_size, *args, timeout_s=timeout_s)
