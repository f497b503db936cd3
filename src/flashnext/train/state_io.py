"""Atomic training checkpoints: `<root>/step_<NNNNNNNN>/{state.pt, meta.json}`, newest N kept.

Writing: everything goes to a hidden temp directory beside the final one, each file is fsynced, the directory is
renamed into place (atomic on POSIX) and the parent directory fsynced; only then are older checkpoints beyond
`keep_last` deleted. A crash at any point leaves every complete checkpoint intact and at most one `.tmp-*`
directory, which the next save removes. A checkpoint directory without `meta.json` is never listed.

`state.pt` is a `torch.save` of plain containers of tensors and numbers (model, optimizers, schedulers, data
position, RNG states), read back with `weights_only=True`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from flashnext.errors import CheckpointError

STATE_FILE, META_FILE = "state.pt", "meta.json"
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
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str | Path) -> dict[str, Any]:
    """Read the state of the checkpoint directory `path`."""
    path = Path(path)
    if not (path / META_FILE).exists() or not (path / STATE_FILE).exists():
        raise CheckpointError(f"{path} is not a complete training checkpoint (needs {STATE_FILE} and {META_FILE})")
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)


def load_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path) / META_FILE
    if not path.exists():
        raise CheckpointError(f"{path.parent} is not a training checkpoint (no {META_FILE})")
    return json.loads(path.read_text())
