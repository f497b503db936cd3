"""The run directory: a new run never starts over a previous one unasked; --overwrite clears exactly the run's
files; final/ is replaced whole; exported files get the permissions every other file gets."""

import json
import os

import pytest
import torch
from test_trainer import _config, _overrides, _write_pretokenized

import flashnext
from flashnext.checkpoint import training
from flashnext.cli.train import main
from flashnext.errors import ConfigError
from flashnext.train import run_dir
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _old_run(out_dir):
    """What a longer earlier run leaves: 3 metric lines, a high-numbered checkpoint, an export with 2 shards."""
    (out_dir / "checkpoints").mkdir(parents=True)
    training.save(out_dir / "checkpoints", 160, {"w": torch.zeros(1)}, {"step": 160}, keep_last=2)
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    (out_dir / "final").mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        (out_dir / "final" / name).write_text("old")
    (out_dir / "notes.txt").write_text("mine")  # not the run's: never touched


@pytest.fixture
def run_args(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl", n=8)
    return _overrides(small_config, tmp_path, data, "--train.steps=2", "--checkpoint.every=1")


def test_a_new_run_into_a_previous_run_is_refused_and_the_old_run_kept(run_args, tmp_path, capsys):
    out = tmp_path / "run"
    _old_run(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(run_args) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"flashnext train: error: out_dir='{out}' already holds a run (metrics.jsonl, checkpoints")
    assert "--resume" in line and "--overwrite" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    with pytest.raises(ConfigError, match="already holds a run"):  # the Python API refuses alike
        Trainer(_config({}, tmp_path, tmp_path / "d.jsonl", "--train.steps=2")).run()


def test_overwrite_clears_the_previous_run_and_keeps_other_files(run_args, tmp_path, capsys):
    out = tmp_path / "run"
    _old_run(out)
    assert main([*run_args, "--overwrite", "--checkpoint.export=true"]) == 0
    assert "overwrite: deleted the previous run's metrics.jsonl, checkpoints, final" in capsys.readouterr().out
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    # keep_last=2 kept the new run's checkpoints (the old step_160 no longer outranks them)
    assert [p.name for p in training.list_checkpoints(out / "checkpoints")] == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in (out / "final").iterdir()) == ["config.json", "model.safetensors"]  # no old shard
    assert (out / "notes.txt").read_text() == "mine"


def test_final_is_replaced_whole_and_loads(run_args, tmp_path):
    out = tmp_path / "run"
    assert main([*run_args, "--checkpoint.export=true"]) == 0
    (out / "final" / "model-00001-of-00009.safetensors").write_text("stale shard of an older export")
    assert main([*run_args, "--train.steps=3", "--resume", "--checkpoint.export=true"]) == 0
    assert not (out / "final" / "model-00001-of-00009.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".final")]
    model = flashnext.from_pretrained(out / "final")
    state = training.load(training.latest(out / "checkpoints"))["model"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)


def test_exported_files_get_the_umask_permissions(run_args, tmp_path):
    old = os.umask(0o027)
    try:
        assert main([*run_args, "--checkpoint.export=true"]) == 0
        probe = tmp_path / "probe"
        probe.write_text("")
    finally:
        os.umask(old)
    expected = probe.stat().st_mode & 0o777  # what open() gives a new file under this umask: 0o640
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "run" / "final").iterdir()}
    assert expected == 0o640 and modes == dict.fromkeys(modes, expected), modes


def test_a_run_dir_without_a_previous_run_is_not_refused(run_args, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.toml").write_text("")  # a config kept beside its run
    assert main(run_args) == 0


def test_resume_continues_this_run_only_and_overwrite_never_deletes_what_it_resumes(tmp_path):
    out = tmp_path / "run"
    _old_run(out)
    own = str(out / "checkpoints" / "step_00000160")
    run_dir.check_out_dir(out, "latest", overwrite=False)
    run_dir.check_out_dir(out, own, overwrite=False)  # rewinding this run
    with pytest.raises(ConfigError, match="already holds a run .* and this one resumes a checkpoint from elsewhere"):
        run_dir.check_out_dir(out, str(tmp_path / "other" / "step_00000002"), overwrite=False)
    with pytest.raises(ConfigError, match="would delete checkpoint.resume="):
        run_dir.check_out_dir(out, own, overwrite=True)
    run_dir.check_out_dir(out, str(tmp_path / "elsewhere"), overwrite=True)  # a checkpoint outside: fine
