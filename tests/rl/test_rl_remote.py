"""The RL loop against a server: rollouts over the token-in route, weights through the admin endpoint. In one
process (fast): after the run the server's engine holds the trainer's weights bitwise. Under torchrun at world size
2 (gloo) with `flashnext serve` in its own process (slow): two steps synced, the n-gram table sent by its owners'
row shards, never gathered whole on any rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
from serve_helpers import running_server  # noqa: E402

from flashnext import save_pretrained
from flashnext.rl.config import load_rl_config  # noqa: E402
from flashnext.rl.inference import post_json  # noqa: E402
from flashnext.rl.loop import RLTrainer  # noqa: E402
from flashnext.serve.engine import Engine  # noqa: E402
from flashnext.serve.server import build_app  # noqa: E402
from flashnext.tokenizer import load_tokenizer  # noqa: E402
from flashnext.train.config import toml_literal  # noqa: E402

KEY = "rl-admin"
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
         "ple_layer_ids": [1], "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
         "hc_lowrank": 8, "ple_embed_dim": 16}  # fmt: skip


def _checkpoint(path: Path) -> Path:
    """A small random model in the official layout (with the tokenizer files): what the server and trainer load."""
    from flashnext.build import build_model
    from flashnext.config import parse_config, tiny_config

    cfg = parse_config({**tiny_config().to_dict(), **SMALL}).text
    save_pretrained(build_model(cfg, seed=0), path)
    load_tokenizer().save(path)
    return path


def _args(tmp_path, ckpt, url, **more) -> list[str]:
    fields = {
        "out_dir": str(tmp_path / "run"), "model.path": str(ckpt), "train.steps": 2, "optim.warmup_steps": 0,
        "orchestrator.batch_size": 2, "orchestrator.group_size": 4, "orchestrator.eval_tasks": 2,
        "orchestrator.max_off_policy_steps": 0, "env.max_tokens": 6, "log.progress": False,
        "checkpoint.export": False, "inference.url": url, **more,
    }  # fmt: skip
    return [f"--{k}={toml_literal(v)}" for k, v in fields.items()]


def test_rl_run_against_a_server_in_one_process(tmp_path, monkeypatch):
    from flashnext.build import from_pretrained

    torch.set_num_threads(2)
    ckpt = _checkpoint(tmp_path / "ckpt")
    engine = Engine(from_pretrained(ckpt), load_tokenizer(), 8, 128, 64)
    monkeypatch.setenv("FLASHNEXT_ADMIN_KEY", KEY)
    with running_server(build_app(engine, "ckpt", admin_key=KEY, log_every=1e9)) as url:
        cfg = load_rl_config(None, _args(tmp_path, ckpt, url))
        trainer = RLTrainer(cfg, say=lambda *a: None)
        history = trainer.run()
    steps = [m for m in history if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["rl/mismatch_kl"] <= 1e-6 and m["sync/tensors"] > 0 for m in steps)
    assert engine.weight_version == 2
    served = dict(engine.model.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in trainer.model.named_parameters())


def _serve(ckpt: Path, env: dict) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "flashnext", "serve", "--model", str(ckpt), "--port", "0", "--max-slots", "8",
           "--max-model-len", "128", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    for line in proc.stdout:
        if m := re.search(r"on (http://[\d.]+:\d+)/v1", line):
            return proc, m.group(1)
        assert time.time() < deadline, "server did not start"
    raise AssertionError(f"server exited: {proc.wait()}")


@pytest.mark.slow
def test_torchrun_world_2_trainer_and_a_server_process(tmp_path):
    from dist_helpers import free_port

    ckpt = _checkpoint(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHNEXT_ADMIN_KEY": KEY}
    server, url = _serve(ckpt, env)
    try:
        probe = Path(__file__).with_name("rl_launch_probe.py")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(probe), str(tmp_path), *_args(tmp_path, ckpt, url)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reply = post_json(f"{url}/inference/v1/generate", {"token_ids": [5, 6, 7]}, None, 60)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert reply["weight_version"] == 2  # the initial sync, then one after each of the two steps
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    tables = {t[0]: t[1] for r in reports for t in r["tables"]}
    assert tables  # the model has an n-gram table, owner-routed
    received = {name: 0 for name in tables}
    for rank, r in enumerate(reports):
        for _name, rows, start, end, local in r["tables"]:
            assert local == end - start < rows  # each rank holds its own rows only
        assert not any(shape and shape[0] in tables.values() for shape in r["gathered"])  # never gathered whole
        own = {t[0]: (t[2], t[3]) for t in r["tables"]}
        for name, rows, start in r["sent"]:
            if name in own:  # a table piece: this rank's rows only
                assert own[name][0] <= start and start + rows <= own[name][1]
                received[name] += rows
        assert rank == 0 or all(name in own for name, _, _ in r["sent"])  # rank 1 sends only its table rows
    syncs = 3  # the start of the run and after each step
    assert received == {name: rows * syncs for name, rows in tables.items()}
