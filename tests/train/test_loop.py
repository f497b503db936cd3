"""The one training loop (`train/loop.py`) with parts plugged in: a run fed by another batch source, with its own
hooks, trains exactly as the data file's run on the same micro-batches; hooks see each step in order, may add
metrics that reach `metrics.jsonl`, and a hook's start row (an evaluation before step 1) is logged as step 0."""

import json

import pytest
import torch
from test_trainer import _config, _write_pretokenized

from flashnext.train.hooks import Evaluation, PeriodicCheckpoint, Report
from flashnext.train.metrics import ProgressBar
from flashnext.train.objective import Alone, CrossEntropy, WithMTP, build_objective
from flashnext.train.trainer import Trainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class ListSource:
    """Fixed micro-batches per step (a stand-in for rollouts); its position is saved like a loader's."""

    def __init__(self, steps: list[list]):
        self.steps, self.taken, self.closed = steps, 0, False

    def next_step(self, step: int) -> list:
        assert step == self.taken  # asked for the step after the trainer's current one
        self.taken += 1
        return self.steps[step]

    def state_dict(self) -> dict:
        return {"list_position": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.taken = state["list_position"]

    def close(self) -> None:
        self.closed = True


class Recorder:
    """Notes each step it sees and adds a metric of its own."""

    def __init__(self):
        self.seen = []

    def start(self, row):
        row["probe/start"] = 1.0

    def after_step(self, metrics, last):
        self.seen.append((metrics["step"], last, "eval_loss" in metrics))
        metrics["probe/seen"] = float(len(self.seen))

    def close(self):
        self.seen.append("closed")


def _workload(steps, recorder):
    class Work:
        def __init__(self, trainer):
            self.trainer, self.source = trainer, ListSource(steps)

        def announce(self):
            self.trainer.peak_flops = 1e9

        def hooks(self):
            t = self.trainer
            evaluation = Evaluation(lambda: {"eval_loss": 0.5}, period=2)
            report = Report.of_run(t, ProgressBar, "eval_loss")
            return [recorder, evaluation, report, PeriodicCheckpoint(t.save_checkpoint, 2, report.write)]

        def summary(self, history):
            return None

    return Work


def test_another_source_and_hooks_run_the_same_steps(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl")
    base = Trainer(_config(small_config, tmp_path / "base", data, "--train.steps=3"))
    steps = [[b for b in base.next_micro_batches()] for _ in range(3)]  # the packed loader's micro-batches
    base = Trainer(_config(small_config, tmp_path / "base", data, "--train.steps=3"))
    reference = base.run()

    recorder = Recorder()
    cfg = _config(small_config, tmp_path / "plug", data, "--train.steps=3")
    plugged = Trainer(cfg, workload=_workload(steps, recorder))
    assert plugged.loader is None and plugged.evaluator is None  # the data file is not read
    history = plugged.run()

    assert [m["loss"] for m in history[1:]] == [m["loss"] for m in reference]  # one process, same ops: bitwise
    assert history[0] == {"step": 0, "probe/start": 1.0}
    # every step, `last` on the final one, before the evaluation hook listed after it; closed after the loop
    assert recorder.seen == [(1, False, False), (2, False, False), (3, True, False), "closed"]
    assert [m.get("eval_loss") for m in history[1:]] == [None, 0.5, 0.5]  # every 2 steps and after the last
    assert plugged.workload.source.closed
    rows = [json.loads(x) for x in (tmp_path / "plug" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and [r.get("probe/seen") for r in rows] == [None, 1, 2, 3]
    saved = torch.load(tmp_path / "plug" / "run" / "checkpoints" / "step_00000002" / "state.pt", weights_only=False)
    assert saved["list_position"] == 2 and saved["step"] == 2  # the source's position is in the checkpoint


def test_objective_composes_the_mtp_loss(small_config, tmp_path):
    data = _write_pretokenized(tmp_path / "d.jsonl")
    cfg = _config(small_config, tmp_path, data, "--train.mtp_loss_weight=0.5")
    objective = build_objective(cfg, torch.device("cpu"))
    assert isinstance(objective, WithMTP) and isinstance(objective.main, CrossEntropy)
    plain = build_objective(_config(small_config, tmp_path, data), torch.device("cpu"))
    assert isinstance(plain, Alone) and isinstance(plain.main, CrossEntropy)
