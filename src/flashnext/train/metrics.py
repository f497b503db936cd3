"""Run metrics: a JSONL file (one object per logged step), a progress bar, optional wandb, and the MFU peak."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flashnext.errors import ConfigError


class MetricsLogger:
    """Append one JSON object per logged step to `path` (rank 0 only).

    On resume from step s, lines of steps after s (written by an interrupted run past its last checkpoint) are
    dropped, so the file reads as one run.
    """

    def __init__(self, path: Path, enabled: bool = True, resume_step: int = 0, wandb: str | None = None):
        self.enabled, self.path, self.file, self.wandb = enabled, Path(path), None, None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
        self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        if wandb is not None:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise ConfigError(
                    f"log.wandb_project={wandb!r} but wandb is not installed (pip install wandb)"
                ) from None
            self.wandb = wandb_lib.init(project=wandb, resume="allow")

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({**metrics, "time": time.time()}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=int(metrics["step"]))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class ProgressBar:
    """tqdm bar over optimizer steps showing loss, the last eval loss, lr and tokens/s (a no-op when disabled)."""

    def __init__(self, total: int, initial: int, enabled: bool = True):
        self.bar = None
        self.eval_loss: float | None = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def note(self, m: dict[str, Any]) -> None:
        """Keep an evaluation's result for the bar (shown until the next one)."""
        self.eval_loss = m.get("eval_loss", self.eval_loss)

    def update(self, m: dict[str, Any]) -> None:
        self.note(m)
        if self.bar is None:
            return
        post = {"loss": f"{m['loss']:.4f}"}
        if self.eval_loss is not None:  # the latest held-out loss stays on the bar between evaluations
            post["eval"] = f"{self.eval_loss:.4f}"
        post.update({"lr": f"{m['lr']:.2e}", "tok/s": f"{m['tokens_per_s']:,.0f}"})
        if "mfu" in m:
            post["mfu"] = f"{m['mfu']:.1%}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, line: str, say: Callable[[str], Any] = print) -> None:
        """Print a line above the bar (tqdm redraws the bar below it); through `say` when there is no bar."""
        if self.bar is None:
            say(line)
        else:
            self.bar.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@torch.no_grad()
def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Achieved FLOP/s of a square `n x n` matmul on `device` (best of a few runs): the MFU denominator.

    On a CPU there is no datasheet number worth quoting for MFU; the achieved dense GEMM rate with the current
    thread count is the ceiling a model's matmuls can reach, so MFU reads as "fraction of GEMM peak".
    """
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
