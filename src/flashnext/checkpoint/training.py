"""Atomic training checkpoints: `<root>/step_<NNNNNNNN>/{state.pt, meta.json}`, newest N kept.

Writing: everything goes to a hidden temp directory beside the final one, each file is fsynced, the directory is
renamed into place (atomic on POSIX) and the parent directory fsynced; only then are older checkpoints beyond
`keep_last` deleted. A crash at any point leaves every complete checkpoint intact and at most one `.tmp-*`
directory, which the next save removes. A checkpoint directory without `meta.json` is never listed.

`state.pt` is a `torch.save` of plain containers of tensors and numbers (model, optimizers, schedulers, data
position, RNG states), read back with `weights_only=True`. A file that cannot be read (a truncated `state.pt`,
a `meta.json` that is not JSON) raises `CheckpointError` naming it; the trainer then resumes from the previous
checkpoint and sets the bad one aside (`set_aside`).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from flashnext.errors import CheckpointError

STATE_FILE, META_FILE = "state.pt", "meta.json"
SHARDED_STATE_FILE = "trainer_state.pt"  # a sharded (DCP, `parallel.dcp`) checkpoint's non-tensor state
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / META_FILE).exists()
    ]
    return [p for _, p in sorted(found)]


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def save(root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> Path:
    """Write `state` (+ `meta` as JSON) as checkpoint `step` atomically, then keep only the newest `keep_last`."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    for name in (STATE_FILE, META_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run that ends where it started)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    _prune(root, keep_last)
    return final


def commit(root: str | Path, path: str | Path, meta: dict[str, Any], keep_last: int) -> None:
    """Mark a checkpoint written by another writer (e.g. a sharded DCP save) complete: write its `meta.json`
    atomically (temp file, fsync, rename), then keep only the newest `keep_last`."""
    path = Path(path)
    tmp = path / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _fsync(tmp)
    os.rename(tmp, path / META_FILE)
    _fsync(path)
    _prune(Path(root), keep_last)


def _prune(root: Path, keep_last: int) -> None:
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: str | Path) -> dict[str, Any]:
    """Read the state of the checkpoint directory `path`.

    Raises:
        CheckpointError: a file is missing, or `state.pt` cannot be read (truncated, corrupt); names the file.
    """
    path = Path(path)
    if not (path / META_FILE).exists() or not (path / STATE_FILE).exists():
        raise CheckpointError(f"{path} is not a complete training checkpoint (needs {STATE_FILE} and {META_FILE})")
    return read_torch_file(path / STATE_FILE, weights_only=True)


def read_torch_file(file: Path, weights_only: bool = True) -> Any:
    """`torch.load` of a checkpoint file; a file torch cannot read raises `CheckpointError` naming it."""
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file} is unreadable (truncated or corrupt?): {reason}") from None


def load_meta(path: str | Path) -> dict[str, Any]:
    """The `meta.json` of the checkpoint directory `path` (step, run config, model config, world size).

    Raises:
        CheckpointError: it is missing, not JSON, or not an object with an integer `step`; names the file.
    """
    path = Path(path) / META_FILE
    if not path.parent.exists():
        raise CheckpointError(f"{path.parent} does not exist")
    if not path.exists():
        raise CheckpointError(f"{path.parent} is not a training checkpoint (no {META_FILE})")
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt (not JSON: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{path} is corrupt (expected an object with an integer 'step')")
    return meta


def read_checkpoint(path: Path) -> dict[str, Any] | None:
    """Read what can be checked before a checkpoint is applied: `meta.json`, and `state.pt` (returned) or the
    sharded format's `trainer_state.pt`; raises `CheckpointError` naming the file that cannot be read."""
    load_meta(path)
    if (Path(path) / SHARDED_STATE_FILE).exists():  # the tensors' own files are read (and checked) by DCP's load
        read_torch_file(Path(path) / SHARDED_STATE_FILE, weights_only=False)
        return None
    return load(path)


def shape_mismatch(path: str | Path, ours: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]) -> None:
    """Refuse to resume `path` into a model of other tensor names or shapes (`{name: shape}` of each side).

    Raises:
        CheckpointError: one line naming each tensor whose shape differs (both shapes; the first few, and how many
            more), else the tensors only one side has.
    """
    problems = [
        f"{k} is {list(saved[k])} in the checkpoint, {list(shape)} in this run's model"
        for k, shape in ours.items()
        if k in saved and tuple(saved[k]) != tuple(shape)
    ]
    problems += [f"{k} ({list(ours[k])}) is not in the checkpoint" for k in ours if k not in saved]
    problems += [f"the checkpoint has {k} ({list(saved[k])}), this run's model not" for k in saved if k not in ours]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"cannot resume {path} into this run's model (another model config?): " + "; ".join(problems[:3]) + more
        )


def set_aside(path: str | Path) -> Path:
    """Rename a bad checkpoint directory `step_N` to `step_N.corrupt[.i]`: no longer listed, resumed or pruned,
    but kept for a look. Returns the new path."""
    path = Path(path)
    target, i = path.with_name(path.name + ".corrupt"), 1
    while target.exists():
        target, i = path.with_name(f"{path.name}.corrupt.{i}"), i + 1
    os.rename(path, target)
    return target
