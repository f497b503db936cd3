"""Report a fatal error of `flashnext train` once per job, as one line, also under `torchrun`.

In a single process the line goes to stderr. Under `torchrun` every rank usually fails the same way (they read the
same config and data), and N copies of the line plus N tracebacks drown the cause. So:
- rank 0 prints the line, then posts it to the launcher's key-value store (the `TCPStore` at `MASTER_ADDR:MASTER_PORT`
  that torchrun's agent hosts for its workers; reachable before any process group exists);
- any other rank waits a few seconds for rank 0's line: the same line -> it stays silent; a different line, or
  none (rank 0 is fine, or slower) -> it prints its own, prefixed with `[rank r]`. Without a reachable store it
  prints with the prefix, so no rank's cause is ever lost;
- every rank also writes its line (or "the same as rank 0's") to torchrun's per-worker error file
  (`TORCHELASTIC_ERROR_FILE`), so the launcher's closing `ChildFailedError` summary names the cause instead of a
  link about enabling tracebacks.
The launcher's summary itself is torchrun's output and cannot be silenced from a worker.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

_WAIT_S = 5.0


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else 0
    except ValueError:
        return 0


def _store():
    """A client of torchrun's agent store, or None outside torchrun / when it cannot be reached."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=_WAIT_S),
        )
    except Exception:  # reporting must never raise: the error being reported matters more
        return None


def _key() -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"flashnext/fatal/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/rank0"


def _record_for_launcher(line: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            # torchrun's structured format (the one its `record` decorator writes), without a traceback to show
            json.dump({"message": {"message": line, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def _rank0_line(store) -> str | None:
    try:
        store.wait([_key()], datetime.timedelta(seconds=_WAIT_S))
        return store.get(_key()).decode("utf-8", "replace")
    except Exception:  # a timeout: rank 0 has not failed (yet)
        return None


def report_fatal(message: str, prog: str = "flashnext train") -> None:
    """Print `prog: error: message` once per job (see the module docstring)."""
    line = f"{prog}: error: {message}"
    rank = _rank()
    store = _store() if "WORLD_SIZE" in os.environ else None
    if rank == 0:
        _record_for_launcher(line)
        print(line, file=sys.stderr, flush=True)  # first: the others may exit (and torchrun end this one) once told
        if store is not None:
            try:
                store.set(_key(), line)
            except Exception:
                pass
        return
    if store is not None and _rank0_line(store) == line:
        _record_for_launcher(f"{prog}: error: the same as rank 0's")  # the summary lists each failed rank
        return
    _record_for_launcher(line)
    print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)
