"""`flashnext plot RUN_DIR`: one PNG per family of metrics, generic over the numeric keys a run logged."""

import json
import sys

import pytest

from flashnext.cli import main
from flashnext.errors import FlashNextError, InputError
from flashnext.train.plot import plan_figures, plot_run

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir()
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo'  # a line cut by a crash: skipped
    (run / "metrics.jsonl").write_text(text)
    return run


def _rows():
    rows = []
    for step in range(1, 9):
        row = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "lr_muon": float("nan"), "tokens_per_s": 100.0 + step,
               "grad_norm": 1.0, "tokens": 512, "time": 1e9 + step, "tokens_seen": 512 * step,
               "rl/mismatch_kl": 0.01, "rl/entropy": 2.0, "reward/mean": step / 8, "custom": 3}  # fmt: skip
        if step % 4 == 0:
            row["eval_loss"] = 5.5 / step
        rows.append(row)
    return rows


def test_panels_cover_every_numeric_key_present():
    figures = dict(plan_figures(_rows()))
    assert figures["loss"] == [("loss", ["loss", "eval_loss"])]
    assert figures["lr"] == [("learning rate", ["lr"])]  # lr_muon is NaN throughout: nothing to draw
    assert figures["throughput"] == [("tokens/s", ["tokens_per_s"])]
    assert figures["rl"] == [("rl/mismatch_kl", ["rl/mismatch_kl"]), ("rl/entropy", ["rl/entropy"])]
    assert figures["reward"] == [("reward/mean", ["reward/mean"])]  # a new family gets its own figure
    assert figures["other"] == [("custom", ["custom"])]
    drawn = {k for panels in figures.values() for _, keys in panels for k in keys}
    assert drawn == {k for k in _rows()[0] if k not in ("step", "time", "tokens_seen", "lr_muon")} | {"eval_loss"}


def test_plot_writes_pngs_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path, _rows())
    assert main(["plot", str(run)]) == 0
    written = [line.removeprefix("wrote ") for line in capsys.readouterr().out.splitlines()]
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == sorted(
        f"{n}.png" for n in ("loss", "lr", "throughput", "grad_norm", "tokens", "rl", "reward", "other")
    )
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == PNG
    assert [p.name for p in plot_run(run, tmp_path / "elsewhere")][0] == "loss.png"


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(FlashNextError, match=r"needs matplotlib, an optional extra: pip install -e '\.\[plot\]'"):
        plot_run(_run_dir(tmp_path, _rows()))
    assert main(["plot", str(tmp_path / "run")]) == 1
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


def test_a_directory_without_metrics_is_named(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(InputError, match=r"nothing/metrics\.jsonl does not exist \(is .*nothing a training run"):
        plot_run(tmp_path / "nothing")
