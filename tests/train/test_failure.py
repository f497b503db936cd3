"""A fatal error prints once per job: rank 0's line, another rank's only when it differs; torchrun's summary names
it; no worker traceback."""

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest
import torch.distributed as dist

from flashnext.train import failure


@pytest.fixture
def store(monkeypatch, tmp_path):
    """A key-value store like torchrun's agent store, and the environment a worker sees."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": uuid.uuid4().hex,
        "WORLD_SIZE": "2",
        "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json"),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(failure, "_WAIT_S", 0.3)
    return server


def _report(monkeypatch, capsys, rank, message):
    monkeypatch.setenv("RANK", str(rank))
    failure.report_fatal(message)
    return capsys.readouterr().err


def test_rank0_prints_and_a_rank_with_the_same_error_stays_silent(store, monkeypatch, capsys, tmp_path):
    assert _report(monkeypatch, capsys, 0, "bad data") == "flashnext train: error: bad data\n"
    record = json.loads((tmp_path / "error.json").read_text())["message"]
    assert record["message"] == "flashnext train: error: bad data"  # what torchrun's summary shows
    assert _report(monkeypatch, capsys, 1, "bad data") == ""
    same = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert same == "flashnext train: error: the same as rank 0's"
    assert _report(monkeypatch, capsys, 1, "disk full") == "[rank 1] flashnext train: error: disk full\n"


def test_a_rank_whose_rank0_did_not_fail_prints_its_error(store, monkeypatch, capsys):
    assert _report(monkeypatch, capsys, 1, "only here") == "[rank 1] flashnext train: error: only here\n"
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")  # no store to ask: print rather than lose it
    assert _report(monkeypatch, capsys, 1, "only here") == "[rank 1] flashnext train: error: only here\n"


def test_a_single_process_prints_the_plain_line(monkeypatch, capsys):
    for k in ("WORLD_SIZE", "RANK", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(k, raising=False)
    failure.report_fatal("x")
    assert capsys.readouterr().err == "flashnext train: error: x\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "bad, expected",
    [
        (["--train.steps=0"], "train.steps: Input should be greater than or equal to 1"),  # before the process group
        (["--data.path=BAD"], "bad.jsonl:2: 'input_ids' has id 64"),  # after it, on every rank
    ],
    ids=["config", "data"],
)
def test_torchrun_errors_print_once_without_worker_tracebacks(small_config, tmp_path, bad, expected):
    from test_trainer import _overrides, _write_pretokenized

    data = _write_pretokenized(tmp_path / "d.jsonl", n=8)
    (tmp_path / "bad.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, 64]}\n')
    args = [a for a in _overrides(small_config, tmp_path, data) if not a.startswith("--data.micro_batches")]
    args += [a.replace("BAD", str(tmp_path / "bad.jsonl")) for a in bad]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "flashnext", "train", *args]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    printed = [line for line in proc.stderr.splitlines() if "flashnext train: error:" in line]
    ours = [line for line in printed if line.startswith(("flashnext train: error:", "[rank"))]
    assert len(ours) == 1 and expected in ours[0], proc.stderr[-3000:]
    assert any(line.strip().startswith("traceback : flashnext train: error:") for line in printed)  # the summary
    assert "flashnext/train/" not in proc.stderr  # no frame of ours: the workers exited cleanly
