"""Resuming: damaged checkpoints fall back to the previous complete one (warning naming the bad file) or are refused
naming it; a finished run says so; every checkpoint saved prints a line."""

import json
import re
import shutil

import pytest
from test_trainer import _config, _overrides, _write_pretokenized

from flashnext.checkpoint import training
from flashnext.cli.train import main
from flashnext.errors import CheckpointError
from flashnext.train.config import toml_literal
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = ["--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep_last=3"]
EVAL = ["--data.eval_fraction=0.2", "--train.eval_every=2"]  # exact resume holds with the held-out loss on


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _write(path, data: bytes):
    path.write_bytes(data)


DAMAGE = {  # name -> (file in the checkpoint directory, how it is damaged)
    "state-truncated": ("state.pt", _truncate),
    "state-empty": ("state.pt", lambda f: _write(f, b"")),
    "meta-not-json": ("meta.json", lambda f: _write(f, b'{"step": 4, "run_co')),
    "meta-not-object": ("meta.json", lambda f: _write(f, b"[4]")),
}


def _damage(name, ckpt_dir):
    file, how = DAMAGE[name]
    how(ckpt_dir / file)
    return ckpt_dir / file


_TRAINED: dict = {}  # one training run for the whole module (each test copies it)


@pytest.fixture
def trained(small_config, tmp_path_factory):
    """One 4-step run with checkpoints at steps 2 and 4: (its directory, its overrides, its metrics, its lines)."""
    if not _TRAINED:
        base = tmp_path_factory.mktemp("resume")
        data = _write_pretokenized(base / "d.jsonl", n=24)
        said = []
        history = Trainer(_config(small_config, base, data, *STEPS, *EVAL), say=said.append).run()
        _TRAINED["run"] = base, _overrides(small_config, base, data, *STEPS, *EVAL), history, said
    return _TRAINED["run"]


@pytest.fixture
def finished_run(trained, tmp_path):
    """A copy of the trained run: (overrides pointing at the copy, its metrics, its checkpoint root)."""
    base, args, history, _ = trained
    shutil.copytree(base / "run", tmp_path / "run")
    args = [f"--out_dir={json.dumps(str(tmp_path / 'run'))}" if a.startswith("--out_dir=") else a for a in args]
    return args, history, tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_reading_a_damaged_checkpoint_names_the_file(finished_run, damage):
    _, _, root = finished_run
    bad = _damage(damage, root / "step_00000004")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(bad))} is (unreadable|corrupt)"):
        training.read_checkpoint(root / "step_00000004")
    training.read_checkpoint(root / "step_00000002")  # the other one is fine


@pytest.mark.parametrize("damage", ["state-truncated", "meta-not-json"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(finished_run, damage, capsys):
    args, history, root = finished_run
    bad = _damage(damage, root / "step_00000004")
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out, err = capsys.readouterr()
    assert f"warning: {bad} is " in err and "trying the previous checkpoint" in err  # names the file
    assert "set the unreadable checkpoint aside as" in err and "step_00000004.corrupt" in err
    assert "resumed from" in out and "step_00000002 at step 2 (1 newer unreadable)" in out
    # steps 3 and 4 ran again exactly as before (eval loss included); the set-aside copy is kept, not listed
    lines = [json.loads(x) for x in (root.parent / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["loss"] for m in lines[2:]] == [m["loss"] for m in history[2:]]
    assert lines[3]["eval_loss"] == history[3]["eval_loss"]
    assert (root / "step_00000004.corrupt").is_dir()
    assert [p.name for p in training.list_checkpoints(root)] == ["step_00000002", "step_00000004"]
    assert training.load(root / "step_00000004")["step"] == 4  # the re-run's own, readable


def test_no_readable_checkpoint_is_refused_naming_every_bad_file(finished_run, capsys):
    args, _, root = finished_run
    _damage("state-truncated", root / "step_00000004")
    _damage("meta-not-json", root / "step_00000002")
    capsys.readouterr()
    assert main([*args, "--resume"]) == 1
    err = capsys.readouterr().err.splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("flashnext train: error: resume=latest: no readable checkpoint")
    assert "step_00000004/state.pt is unreadable" in errors[0] and "step_00000002/meta.json is corrupt" in errors[0]
    assert not list(root.glob("*.corrupt"))  # nothing moved when nothing resumed


@pytest.mark.parametrize("damage", ["state-truncated", "meta-not-json"])
def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(finished_run, damage, capsys):
    args, _, root = finished_run
    bad = _damage(damage, root / "step_00000004")
    capsys.readouterr()
    assert main([*args, f"--resume={root / 'step_00000004'}"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"flashnext train: error: {bad} ")


def test_resume_of_a_finished_run_says_so_and_changes_nothing(finished_run, capsys):
    args, _, root = finished_run
    metrics = (root.parent / "metrics.jsonl").read_text()
    before = {p.name: p.stat().st_mtime_ns for p in root.iterdir()}
    capsys.readouterr()
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out
    assert "run already finished at step 4 (train.steps=4); raise --train.steps to continue" in out
    assert (root.parent / "metrics.jsonl").read_text() == metrics
    assert {p.name: p.stat().st_mtime_ns for p in root.iterdir()} == before


def test_every_checkpoint_saved_prints_a_line(trained):
    base, _, _, said = trained
    saved = [line for line in said if line.startswith("checkpoint: ")]
    root = base / "run" / "checkpoints"
    assert [line.split(" ")[1] for line in saved] == [str(root / "step_00000002"), str(root / "step_00000004")]
    assert all(re.fullmatch(r"checkpoint: \S+ \(\d+\.\ds\)", line) for line in saved)  # path, seconds


def test_resume_into_another_shape_names_the_tensor_and_both_shapes(finished_run, small_config, capsys):
    """The run's model config changed since the checkpoint (a larger vocabulary): one error line naming the tensor
    and both shapes (before: torch's uncaught multi-line RuntimeError from `load_state_dict`)."""
    args, _, root = finished_run
    wider = dict(small_config, vocab_size=small_config["vocab_size"] + 8)
    args = [f"--model.overrides={toml_literal(wider)}" if a.startswith("--model.overrides=") else a for a in args]
    capsys.readouterr()
    assert main([*args, f"--resume={root / 'step_00000004'}"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    v = small_config["vocab_size"]
    d = small_config["hidden_size"]
    assert line.startswith(f"flashnext train: error: cannot resume {root / 'step_00000004'}"), line
    assert f"model.embed_tokens.weight is [{v}, {d}] in the checkpoint, [{v + 8}, {d}] in this run's model" in line


def test_sharded_resume_into_another_shape_names_the_tensor_and_both_shapes(small_config, tmp_path):
    """The DCP format (one process, no process group): refused before DCP reads, naming the tensor and shapes."""
    import torch

    from flashnext.build import build_model
    from flashnext.config import parse_config
    from flashnext.parallel import load_state, save_state

    small = build_model(parse_config(small_config).text, seed=0)
    save_state(tmp_path / "ck", small, {}, extra={})
    wide = build_model(parse_config(dict(small_config, hidden_size=24, head_dim=8)).text, seed=0)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"cannot resume .*ck.*model\.embed_tokens\.weight is \[64, 16\] in the "
                                              r"checkpoint, \[64, 24\] in this run's model"):  # fmt: skip
        load_state(tmp_path / "ck", wide, {})
    assert all(torch.equal(v, before[k]) for k, v in wide.state_dict().items())
