"""A bad URL or path given to a command is refused in one line naming it (no traceback), before any work."""

from __future__ import annotations

import pytest

from flashnext.cli import main


@pytest.fixture
def places(tmp_path):
    (tmp_path / "a_file").write_text("not a directory\n")
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "not.safetensors").write_bytes(b"\xff" * 64)  # its 'header length' is 2^64 - 1
    return tmp_path


CASES = {
    "rl-url-words": (["rl", "--inference-url", "not a url"], "'not a url'"),
    "rl-url-no-host": (["rl", "--inference-url=http://"], "'http://'"),
    "rl-url-scheme": (["rl", "--inference-url", "ftp://host:8000"], "'ftp://host:8000'"),
    "rl-url-port": (["rl", "--inference-url", "http://host:99999"], "'http://host:99999'"),
    "train-out-dir-file": (["train", "--out_dir={p}/a_file", "--train.steps=1"], "out_dir='{p}/a_file' is a file"),
    "train-config-dir": (["train", "--config", "{p}/a_dir"], "run config {p}/a_dir is a directory"),
    "train-model-path": (["train", "--model.path={p}/absent", "--out_dir={p}/run"], "model.path='{p}/absent'"),
    "rl-model-path": (["rl", "--model.path={p}/a_dir", "--out_dir={p}/run"], "model.path='{p}/a_dir'"),
    "convert-missing-checkpoint": (["convert", "--checkpoint", "{p}/absent", "--out", "{p}/out"],
                                   "{p}/absent does not exist"),  # fmt: skip
    "quantize-not-safetensors": (["quantize", "--ngram", "fp8", "{p}/not.safetensors", "{p}/out"],
                                 "not.safetensors: not a safetensors file"),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_url_or_path_is_one_line_naming_it(places, case, capsys):
    argv, needle = CASES[case]
    argv = [a.replace("{p}", str(places)) for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flashnext {argv[0]}: error: "), err
    assert needle.replace("{p}", str(places)) in err[0], err[0]
