"""Where a checkpoint writer puts its files: a new directory, never mixed into another checkpoint.

Every writer (`save_pretrained`, `parallel.export_pretrained`, `flashnext convert`, `flashnext quantize`) refuses a
target directory that holds anything, unless told to overwrite (`--overwrite`, `overwrite=True`): a checkpoint
written over another one with more shards, or other file names, would leave the old files beside the new ones, and
a loader reading the old index would load the old model. The files are written into a hidden staging directory
beside the target (`.NAME.partial`, a fixed name so that every rank of a distributed export agrees on it), which
then replaces the target whole: the old directory is renamed aside (`.NAME.old`), the staged one renamed into
place, the old one deleted. A writer that fails leaves the target as it was (and removes its staging directory);
a crash leaves the target complete, old or new (a leftover `.NAME.partial`/`.NAME.old` is cleared next time).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from flashnext.errors import CheckpointError


def check_target(directory: str | Path, overwrite: bool) -> None:
    """Refuse to write a checkpoint into `directory` when it is a file, or a directory holding anything (unless
    `overwrite`).

    Raises:
        CheckpointError: one line naming the directory, a few of its entries and the `--overwrite` flag.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"cannot write a checkpoint to {str(directory)!r}: it is a file, not a directory")
    if overwrite or not directory.is_dir():
        return
    held = sorted(p.name for p in directory.iterdir())
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise CheckpointError(
            f"{str(directory)!r} is not empty (holds {shown}); pass --overwrite (overwrite=True from Python) to "
            "replace it whole, or choose another directory"
        )


def staging_dir(directory: str | Path) -> Path:
    """The hidden directory beside `directory` a checkpoint is written into before it replaces `directory`."""
    directory = Path(directory)
    return directory.parent / f".{directory.name}.partial"


def begin_staging(directory: str | Path) -> Path:
    """Create an empty `staging_dir(directory)` (removing what an interrupted writer left there); returns it."""
    tmp = staging_dir(directory)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def replace_with(tmp: str | Path, directory: str | Path) -> Path:
    """Make the staged `tmp` the directory `directory` (whose old contents are deleted); returns `directory`."""
    tmp, directory = Path(tmp), Path(directory)
    old = directory.parent / f".{directory.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if directory.is_dir():
        os.rename(directory, old)
    os.rename(tmp, directory)
    with contextlib.suppress(OSError):  # the renames reach the disk before the old files are deleted
        fd = os.open(directory.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    shutil.rmtree(old, ignore_errors=True)
    return directory


@contextlib.contextmanager
def writing(directory: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """`with writing(dir, overwrite) as tmp:` write the checkpoint's files into `tmp`; on success they replace
    `dir` whole, on an exception `dir` is left as it was. See `check_target` for the refusal."""
    check_target(directory, overwrite)
    tmp = begin_staging(directory)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_with(tmp, directory)
