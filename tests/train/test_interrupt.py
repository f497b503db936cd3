"""`flashnext train` keeps its work too (the mechanism `flashnext rl` uses, `train/interrupt.py`): Ctrl-C finishes the
step, saves it and exits 130, and the resumed run repeats the uninterrupted one bit for bit; a non-finite loss is
refused before the update, so the checkpoint saved after it holds the last good step's weights."""

import os
import signal

import pytest
import torch
from test_trainer import _config, _overrides, _write_pretokenized

from flashnext.checkpoint import training
from flashnext.cli.train import main
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_ctrl_c_saves_the_step_and_resume_is_exact(small_config, tmp_path, monkeypatch, capsys):
    data = _write_pretokenized(tmp_path / "d.jsonl")
    real = Trainer.train_step

    def train_step(self, batches):
        out = real(self, batches)
        if self.step == 3:  # Ctrl-C while step 3 runs (the handler only takes note)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    def unhandled(signum, frame):  # a run that does not take the signal fails this test, not the pytest session
        raise RuntimeError("SIGINT reached the test's handler: the run did not handle it")

    monkeypatch.setattr(Trainer, "train_step", train_step)
    args = _overrides(small_config, tmp_path / "cut", data, "--train.steps=5")
    before = signal.signal(signal.SIGINT, unhandled)
    try:
        assert main(args) == 130
    finally:
        signal.signal(signal.SIGINT, before)
    saved = training.step_dir(tmp_path / "cut" / "run" / "checkpoints", 3)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"flashnext train: stopped by SIGINT after step 3: checkpoint {saved}; to continue, run the same command "
        "with --resume (without --overwrite)"
    )
    monkeypatch.setattr(Trainer, "train_step", real)
    rest = Trainer(_config(small_config, tmp_path / "cut", data, "--train.steps=5", "--checkpoint.resume=latest")).run()
    full = Trainer(_config(small_config, tmp_path / "full", data, "--train.steps=5")).run()
    assert [m["step"] for m in rest] == [4, 5]
    assert [m["loss"] for m in rest] == [m["loss"] for m in full[3:]]  # one process, same ops: bitwise


def test_a_nan_loss_leaves_the_weights_and_saves_the_last_good_step(small_config, tmp_path, monkeypatch):
    data = _write_pretokenized(tmp_path / "d.jsonl")
    real = Trainer._accumulate

    def accumulate(self, *args):
        loss_sum, mtp_sum, rl_sums = real(self, *args)
        return (loss_sum * float("nan") if self.step == 2 else loss_sum), mtp_sum, rl_sums

    monkeypatch.setattr(Trainer, "_accumulate", accumulate)
    trainer = Trainer(_config(small_config, tmp_path, data, "--train.steps=4"))
    with pytest.raises(FloatingPointError, match=r"^step 3: loss is nan \(the weights were not updated\)") as info:
        trainer.run()
    saved = training.step_dir(tmp_path / "run" / "checkpoints", 2)
    assert info.value.__notes__ == [
        f"saved the checkpoint of step 2 (the last completed) to {saved}; to continue, run the same command with "
        "--resume (without --overwrite)"
    ]
    state = training.load(saved)
    assert state["step"] == 2 and trainer.step == 2
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, state["model"][name]), name  # step 3 never reached the weights
        assert torch.isfinite(tensor).all(), name
