"""`torchrun -m flashnext train` at world size 2 (gloo) takes the same steps as one process, and its sharded
checkpoint resumes in one process."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from dist_helpers import free_port

from flashnext.train.config import load_run_config, toml_literal
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _data(path, n=16, vocab=64, rl=False):
    gen = torch.Generator().manual_seed(3)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(0, vocab, (int(torch.randint(4, 20, (1,), generator=gen)),), generator=gen).tolist()
            record = {"input_ids": ids}
            if rl:  # a rollout: loss on the second half, the engine's log-probs off the model's, an advantage
                half = len(ids) // 2
                record["labels"] = [-100] * half + ids[half:]
                record["inference_logprobs"] = (-torch.rand(len(ids), generator=gen) * 4 - 1).tolist()
                record["advantages"] = float(torch.randn((), generator=gen))
            f.write(json.dumps(record) + "\n")
    return path


def _torchrun_2(args: list[str], out_dir) -> str:
    """`torchrun --nproc-per-node 2 -m flashnext train` (gloo) with 2 micro-batches per rank; returns its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "flashnext", "train", *args, f"--out_dir={out_dir}",
           "--data.micro_batches=2"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_world_size_2_equals_one_process_and_resumes_in_one(small_config, tmp_path):
    data = _data(tmp_path / "d.jsonl")
    common = [
        f"--data.path={data}",
        "--data.token_budget=48",
        "--optim.warmup_steps=1",
        "--log.progress=false",
        "--log.peak_flops=1e9",
        "--train.steps=3",
        "--train.activation_checkpointing=true",
        "--checkpoint.every=2",
        "--checkpoint.export=false",
        "--model.overrides=" + toml_literal(small_config),
    ]
    # the same global batch: 4 micro-batches in one process, 2 per rank on 2 ranks (gradient sync on the last only)
    said = []
    single = Trainer(
        load_run_config(None, [*common, f"--out_dir={tmp_path / 'one'}", "--data.micro_batches=4"]), say=said.append
    )
    single.run()

    printed = _torchrun_2(common, tmp_path / "two")
    # the same whole-model parameter count (ranks hold halves of the n-gram table and of every FSDP2 shard)
    one_count = re.search(r"model: ([\d.]+)M params on", "\n".join(said))
    two_count = re.search(r"model: ([\d.]+)M params \(([\d.]+)M held by rank 0 of 2\) on", printed)
    assert one_count and two_count, printed[:2000]
    assert two_count[1] == one_count[1] and float(two_count[2]) < float(one_count[1])
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["step"] for m in two] == [1, 2, 3]  # rank 0 alone writes metrics
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["tokens"] == a["tokens"]

    # the world-size-2 (sharded) checkpoint of step 2 continues in one process to the same step 3
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000002"
    assert (ckpt / "meta.json").exists() and json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    resumed = Trainer(
        load_run_config(
            None, [*common, f"--out_dir={tmp_path / 'three'}", "--data.micro_batches=4", f"--checkpoint.resume={ckpt}"]
        )
    )
    (last,) = resumed.run()
    assert last["step"] == 3 and last["loss"] == pytest.approx(two[-1]["loss"], rel=1e-6, abs=1e-7)
    for (name, a), b in zip(single.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)  # sums reduced in another order


def test_torchrun_rl_metrics_are_global(small_config, tmp_path):
    """Under torchrun the `rl/*` metrics are loss-token means over every rank's micro-batches: the same numbers
    as one process taking the same global batch (not rank 0's own share)."""
    data = _data(tmp_path / "rl.jsonl", rl=True)
    common = [
        f"--data.path={data}",
        "--data.token_budget=48",
        "--train.loss=rl",
        "--log.progress=false",
        "--train.steps=2",
        "--checkpoint.export=false",
        "--model.overrides=" + toml_literal(small_config),
    ]
    Trainer(load_run_config(None, [*common, f"--out_dir={tmp_path / 'one'}", "--data.micro_batches=4"])).run()
    _torchrun_2(common, tmp_path / "two")
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    rl_keys = sorted(k for k in one[0] if k.startswith("rl/"))
    assert "rl/mismatch_kl" in rl_keys
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        for k in rl_keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k


def test_torchrun_ranks_agree_to_stop_when_one_is_signalled(small_config, tmp_path):
    """SIGTERM to rank 1 alone: the flag is all-reduced between steps, so both ranks stop after the same step and
    write its sharded checkpoint together (a rank that stopped alone would leave the other in a collective)."""
    import signal
    import time

    data = _data(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "flashnext", "train", f"--data.path={data}",
           "--data.token_budget=48", "--log.progress=false", "--log.peak_flops=1e9", "--train.steps=100000",
           "--checkpoint.export=false", "--model.overrides=" + toml_literal(small_config),
           f"--out_dir={out}"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").exists() and len(_metrics(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never took two steps"
            time.sleep(0.1)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ranks = {p: open(f"/proc/{p}/environ", "rb").read().split(b"\0") for p in workers}  # exact entries
        (rank1,) = [int(p) for p, env in ranks.items() if b"RANK=1" in env]
        os.kill(rank1, signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode != 0  # torchrun reports its workers' status 143 as a failure
    last = _metrics(out)[-1]["step"]
    saved = out / "checkpoints" / f"step_{last:08d}"
    assert json.loads((saved / "meta.json").read_text())["world_size"] == 2, err[-3000:]
    assert f"flashnext train: stopped by SIGTERM after step {last}: checkpoint {saved}" in err
