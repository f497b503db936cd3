"""examples/lm_eval_local/run.sh end to end: lm-eval-harness 0.4.13, unmodified, runs a loglikelihood task and a
multiple-choice task against `flashnext serve` (batched requests: BATCH=4). Needs lm-eval installed
(`pip install 'lm-eval[api]==0.4.13'`): an optional suite, skipped without it (CI runs it in its extras venv)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's [api] extra, which its API models need

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lm_eval_local"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lm_eval_runs_a_loglikelihood_and_a_multiple_choice_task(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PORT": str(_free_port()), "BATCH": "4", "LIMIT": "8"}
    proc = subprocess.run(["bash", str(EXAMPLE / "run.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted((EXAMPLE / "results").rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(files[-1].read_text())["results"]
    assert 0.0 <= results["flashnext_reverse_mc"]["acc,none"] <= 1.0
    assert results["flashnext_last_word"]["perplexity,none"] > 1.0  # a finite perplexity: log-probs came back
