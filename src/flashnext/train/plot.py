"""`flashnext plot RUN_DIR`: PNG curves of every numeric metric in a run's `metrics.jsonl`, against the step.

Figures (one PNG each, under `RUN_DIR/plots/` by default; a figure is drawn only for keys the file has):
- `loss.png`: the training loss and the held-out `eval_loss` (dots: it is computed every `train.eval_every` steps);
- `lr.png`: the learning rates (`lr`: AdamW groups, `lr_muon`);
- `throughput.png`: tokens/s, model FLOP/s and MFU, one panel each;
- `grad_norm.png`, `step_time.png` (seconds per step and its parts), `tokens.png` (tokens per step);
- one figure per key prefix (`rl/mismatch_kl`, `rl/entropy`, ... -> `rl.png`), one panel per key, so new metric
  families (rewards, ...) get their curves without a change here;
- `other.png`: any remaining numeric key, one panel each.
`step`, `time` and `tokens_seen` are axes, not curves. matplotlib is an optional extra (`pip install -e '.[plot]'`);
only its object API is used (no pyplot state, no display needed).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from flashnext.errors import FlashNextError, InputError

# (figure, [(panel title, [keys drawn together])]) for the trainer's own metrics
_KNOWN = [
    ("loss", [("loss", ["loss", "eval_loss"])]),
    ("lr", [("learning rate", ["lr", "lr_muon"])]),
    ("throughput", [("tokens/s", ["tokens_per_s"]), ("model FLOP/s", ["model_flops_per_s"]), ("MFU", ["mfu"])]),
    ("grad_norm", [("gradient norm (before clipping)", ["grad_norm"])]),
    ("step_time", [("seconds per step", ["seconds", "seconds_fwd_bwd", "seconds_optim"])]),
    ("tokens", [("tokens per step", ["tokens", "loss_tokens"])]),
]
_AXES = {"step", "time", "tokens_seen"}
Figures = list[tuple[str, list[tuple[str, list[str]]]]]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a `metrics.jsonl` (a line cut short by a crash is skipped)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path} does not exist (is {path.parent} a training run's out_dir?)")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int | float):
            rows.append(row)
    if not rows:
        raise InputError(f"{path} has no metrics lines (objects with a 'step')")
    return rows


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def plan_figures(rows: list[dict[str, Any]]) -> Figures:
    """Which keys go in which figure and panel (see the module docstring); only keys with a finite value."""
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in _AXES]
    keys = [k for k in keys if any(_numeric(row.get(k)) for row in rows)]
    placed: set[str] = set()
    figures: Figures = []
    for name, panels in _KNOWN:
        kept = [(title, [k for k in ks if k in keys]) for title, ks in panels]
        kept = [(title, ks) for title, ks in kept if ks]
        if kept:
            figures.append((name, kept))
            placed.update(k for _, ks in kept for k in ks)
    rest = [k for k in keys if k not in placed]
    groups: dict[str, list[str]] = {}
    for k in rest:
        groups.setdefault(k.split("/", 1)[0] if "/" in k else "other", []).append(k)
    for prefix, ks in groups.items():
        if prefix != "other":
            figures.append((prefix, [(k, [k]) for k in ks]))
    if "other" in groups:
        figures.append(("other", [(k, [k]) for k in groups["other"]]))
    return figures


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise FlashNextError(
            "flashnext plot needs matplotlib, an optional extra: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    return Figure


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the PNG figures of `run_dir/metrics.jsonl` to `out` (default `run_dir/plots`); returns their paths."""
    Figure = _figure_class()
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    out = Path(out) if out is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, panels in plan_figures(rows):
        cols = min(len(panels), 3)
        nrows = math.ceil(len(panels) / cols)
        fig = Figure(figsize=(5.5 * cols, 3.6 * nrows), layout="constrained")
        axes = fig.subplots(nrows, cols, squeeze=False).ravel()
        for ax, (title, keys) in zip(axes, panels, strict=False):
            for key in keys:
                pts = [(row["step"], row[key]) for row in rows if _numeric(row.get(key))]
                sparse = len(pts) < 0.5 * len(rows)  # e.g. eval_loss: mark the points it was computed at
                ax.plot(*zip(*pts, strict=True), marker="o" if sparse else None, markersize=3, label=key)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if len(keys) > 1:
                ax.legend()
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(f"{Path(run_dir).resolve().name}: {name}")
        path = out / f"{_safe(name)}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "metrics"
