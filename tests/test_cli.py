"""The `flashnext` command line: every command listed, unknown ones refused with a suggestion, help when bare,
--version, and `flashnext train` failing with one line and status 1 for every kind of bad input."""

import importlib.util
import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from flashnext.cli import _COMMANDS, build_parser, main

ROOT = Path(__file__).parents[1]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("serve", "generate", "train", "rl", "plot", "convert", "demo", "flops", "quantize", "plan"):
        assert f"\n    {name} " in out, name
    names = {"serve", "generate", "train", "rl", "plot", "convert", "demo", "flops", "quantize", "plan"}
    assert set(_COMMANDS) == names


def test_bare_flashnext_prints_help_and_how_to_run_the_demo(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashnext") and "flashnext demo" in out and "flashnext serve" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serv"], "unknown command 'serv'; did you mean 'serve'?"),
        (["trian", "--train.steps=3"], "unknown command 'trian'; did you mean 'train'?"),
        (
            ["xyzzy"],
            "unknown command 'xyzzy' (commands: serve, generate, train, rl, plot, convert, demo, flops, quantize, "
            "plan)",
        ),
        (["--seq-len", "8"], "unknown command '--seq-len'; options follow a command, e.g. `flashnext demo --seq-len`"),
    ],
    ids=["serve", "train", "no-match", "option-first"],
)
def test_an_unknown_command_is_an_error_with_a_suggestion(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"flashnext: error: {message}" in err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"flashnext {version('flashnext')}"


def test_demo_and_the_readme_commands_still_parse_and_run(capsys):
    assert main(["demo", "--seq-len", "8", "--repeats", "1"]) == 0
    assert "check: padded logits == packed logits" in capsys.readouterr().out
    assert build_parser().parse_args(["serve"]).command == "serve"  # README: `flashnext serve`
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    helped = capsys.readouterr().out
    assert e.value.code == 0 and "--overwrite" in helped and "parallel" in helped  # every config section


def _pretokenized(path, lines):
    path.write_bytes(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n" for x in lines))
    return path


SHIPPED = str(ROOT / "configs" / "tiny-sft.toml")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", SHIPPED, "--train.steps=4"],
         "optim.warmup_steps=5 exceeds train.steps=4, the length of the lr schedule; lower optim.warmup_steps, raise "
         f"train.steps, or set optim.total_steps (optim.warmup_steps from {SHIPPED}; train.steps from "
         "--train.steps=4 on the command line)"),
        (["--train.steps=0"], "train.steps: Input should be greater than or equal to 1 (got 0, from --train.steps=0"),
        (["--data.path=TMP/ids.jsonl"],
         "ids.jsonl:2: 'input_ids' has id 512 at position 1 >= the model's vocab_size=512"),
        (["--data.path=TMP/utf8.jsonl"], "utf8.jsonl:1: invalid UTF-8 (byte 0xff at byte 14 of the line)"),
        (["--data.path=TMP/none.jsonl"], "data.path='TMP/none.jsonl' does not exist"),
        (["--resume=TMP"], "TMP is not a training checkpoint (no meta.json)"),
        (["--resume=TMP/nowhere"], "TMP/nowhere does not exist"),
        (["--train.steps", "4"], "unknown argument '--train.steps': overrides take the form --section.field=value"),
        (["--log.wandb_project=x"], "log.wandb_project='x' but wandb is not installed"),
    ],
    ids=["warmup", "steps0", "id>=vocab", "utf8", "no-data", "not-a-checkpoint", "missing-checkpoint", "space-override",
         "no-wandb"],
)  # fmt: skip
def test_train_errors_are_one_line_and_status_1(tmp_path, capsys, args, expected):
    if "wandb" in expected and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    _pretokenized(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 512]}])
    _pretokenized(tmp_path / "utf8.jsonl", [b'{"prompt": "a\xff", "completion": "b"}\n'])
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    out_dir = f"--out_dir={tmp_path / 'run'}"
    assert main(["train", out_dir, "--log.progress=false", "--log.peak_flops=1e9", *args]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flashnext train: error: ") and expected.replace("TMP", str(tmp_path)) in line


def test_rl_errors_are_one_line_naming_rl(tmp_path, capsys):
    """`flashnext rl` shares the training commands' runner; its error line names its own command."""
    assert main(["rl", f"--out_dir={tmp_path / 'run'}", "--orchestrator.group_size=0"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("flashnext rl: error: ") and "orchestrator.group_size" in line


def test_train_error_through_the_console_entry_has_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flashnext", "train", f"--resume={tmp_path}", f"--out_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == f"flashnext train: error: {tmp_path} is not a training checkpoint (no meta.json)\n"


def test_a_run_config_for_the_other_command_says_which_runs_it(capsys):
    assert main(["train", "--config", str(ROOT / "configs" / "tiny-rl.toml")]) == 1
    err = capsys.readouterr().err
    assert "orchestrator: unknown key" in err and "is an RL run config" in err and "flashnext rl --config" in err
    assert main(["rl", "--config", SHIPPED, "--print-config"]) == 1
    err = capsys.readouterr().err
    assert "none of the RL ones" in err and "flashnext train --config" in err


_WAIT_POLICY_PROBE = """
import os, sys

class Probe:  # records OMP_WAIT_POLICY at the moment torch is first imported (when OpenMP reads it)
    seen = "torch never imported"

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Probe.seen == "torch never imported":
            Probe.seen = os.environ.get("OMP_WAIT_POLICY", "unset")
        return None

sys.meta_path.insert(0, Probe())
from flashnext.cli import main
main(["generate", "--prompt", "Hi", "--max-tokens", "1"])
print("policy-at-torch-import:", Probe.seen)
"""


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_every_command_sets_openmp_waiting_before_torch_loads(given, expected):
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads: the command line must set its default (passive: threads
    sleep while they wait, which keeps a busy box fast) before anything imports torch; a value the user set wins."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", _WAIT_POLICY_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"policy-at-torch-import: {expected}" in out.stdout, out.stdout + out.stderr
