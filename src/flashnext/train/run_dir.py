"""A run directory's life cycle: refuse to start over a previous run, clear it on request, swap `final/` whole.

`<out_dir>` holds one run: `metrics.jsonl`, `checkpoints/`, `final/` (the exported model) and `plots/`. A new run
(no `--resume`) into an `out_dir` that already holds any of them is refused: it would cut `metrics.jsonl` short,
its new checkpoints would sort below the old run's (and `keep_last` would delete them), and `final/` would mix two
runs' files. `--overwrite` (`train.overwrite=true`) deletes exactly those entries first; other files in
`out_dir` (a run config kept beside its run, notes) are never touched.

`final/` is replaced as a whole: the export is written to a hidden temp directory beside it, then swapped in with
two renames (the old `final/` aside, the new one into place) and the old one deleted. A crash leaves either the
old or the new export complete (briefly only the `.final.old` copy, next to a complete `.final.tmp`), never a
directory mixing both.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from flashnext.errors import ConfigError

RUN_ENTRIES = ("metrics.jsonl", "checkpoints", "final", "plots")
_TMP, _OLD = ".final.tmp", ".final.old"


def previous_run(out_dir: str | Path) -> list[str]:
    """The entries of a previous run in `out_dir` (empty when there is none)."""
    out_dir = Path(out_dir)
    return [name for name in RUN_ENTRIES if (out_dir / name).exists()]


def check_out_dir(out_dir: str | Path, resume: str | None, overwrite: bool) -> None:
    """Refuse a new run into an `out_dir` holding a previous one, unless it resumes that run or overwrites it.

    Resuming means `latest` or a checkpoint inside `out_dir`; a checkpoint from elsewhere starts a new run here, so
    it is refused like a fresh start (it would rewrite this run's metrics and outrank or prune its checkpoints).

    Raises:
        ConfigError: naming `out_dir`, what it holds, and the ways on; or when `overwrite` would delete the
            checkpoint `resume` names; or when `out_dir` is a file.
    """
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f"out_dir={str(out_dir)!r} is a file; --out_dir takes a directory (created if absent)")
    found = previous_run(out_dir)
    inside = resume not in (None, "latest") and Path(resume).resolve().is_relative_to(Path(out_dir).resolve())
    if overwrite:
        if inside and found:
            raise ConfigError(
                f"train.overwrite=true would delete checkpoint.resume={resume!r}, which is inside "
                f"out_dir={str(out_dir)!r}; copy it elsewhere first or drop --overwrite"
            )
        return
    if found and not (resume == "latest" or inside):
        how = "resumes a checkpoint from elsewhere" if resume is not None else "would start over"
        raise ConfigError(
            f"out_dir={str(out_dir)!r} already holds a run ({', '.join(found)}) and this one {how}; continue that "
            f"run with --resume, start over with --overwrite (train.overwrite=true: deletes {', '.join(found)}), "
            "or choose another --out_dir"
        )


def clear_run(out_dir: str | Path) -> list[str]:
    """Delete the previous run's entries (and any half-swapped export) from `out_dir`; returns what was deleted."""
    out_dir = Path(out_dir)
    gone = []
    for name in (*RUN_ENTRIES, _TMP, _OLD):
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


def export_dir(final: str | Path, clear: bool = True) -> Path:
    """The temp directory an export of `final` is written to (a fixed name, so every rank agrees); `clear`
    (rank 0) removes what an interrupted export left there."""
    tmp = Path(final).parent / _TMP
    if clear and tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def swap_in(tmp: str | Path, final: str | Path) -> Path:
    """Replace the directory `final` by `tmp` (see the module docstring); returns `final`."""
    tmp, final = Path(tmp), Path(final)
    old = final.parent / _OLD
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the renames reach the disk before the old export is deleted
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)
    return final


def claim(out_dir: Path, resume: str | None, overwrite: bool, ctx, say=print) -> None:
    """Refuse a previous run in `out_dir` (unless resuming), or clear it with `overwrite` (rank 0); every rank of
    `ctx` (a `DistContext`) waits until then, so nobody writes before rank 0 has checked and cleared."""
    if ctx.is_main:
        check_out_dir(out_dir, resume, overwrite)
        if overwrite:
            gone = clear_run(out_dir)
            if gone:
                say(f"overwrite: deleted the previous run's {', '.join(gone)} in {out_dir}")
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def export_model(model, tokenizer, ctx, path: str | Path) -> None:
    """`model`'s weights in the official Hugging Face layout (+ the tokenizer's files) at `path`; collective.

    The export is written to a temp directory beside `path`, which then replaces `path` whole (no file of an
    older export survives beside the new one). With a process group every rank writes what it owns (n-gram
    table shards) and rank 0 the rest.
    """
    path = Path(path)
    tmp = export_dir(path, clear=ctx.is_main)
    if ctx.distributed:
        import torch.distributed as dist

        from flashnext.parallel import export_pretrained

        dist.barrier()  # rank 0 emptied the temp directory
        export_pretrained(model, tmp)
    else:
        from flashnext.checkpoint import save_pretrained

        save_pretrained(model, tmp)
    if ctx.is_main:
        if tokenizer is not None and hasattr(tokenizer, "save"):
            tokenizer.save(tmp)
        swap_in(tmp, path)
