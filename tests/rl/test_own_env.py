"""A user's own environment runs on the first try: `module:Class` from the working directory (as `python -m`
imports), and a recipe's `env.args` (written for its own env) are not passed to the environment named instead."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from flashnext.rl.config import RLRunConfig
from flashnext.rl.envs import load_environment
from flashnext.train.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "tiny-rl.toml"


def test_the_working_directory_is_importable(tmp_path, monkeypatch):
    shutil.copy(ROOT / "examples" / "own_env" / "letter_env.py", tmp_path / "letter_env.py")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "letter_env", raising=False)
    env = load_environment("letter_env:LetterEnv", {}, seed=0, eval_percent=10, max_tokens=8)
    task = env.task("train", 0)
    assert env.score(task, f" {task['letter']}at").reward == 1.0 and env.score(task, " ").reward == 0.0


def test_a_recipes_env_args_stay_with_its_env(capsys):
    cfg = load_run_config(RECIPE, ["--env.name=letter_env:LetterEnv"], cls=RLRunConfig)
    assert cfg.env.name == "letter_env:LetterEnv" and cfg.env.args == {}
    assert "env.args from" in capsys.readouterr().err
    kept = load_run_config(RECIPE, ["--env.name=letter_env:LetterEnv", "--env.args.x=1"], cls=RLRunConfig)
    assert kept.env.args["x"] == 1  # args given beside the name are the user's
    same = load_run_config(RECIPE, [], cls=RLRunConfig)
    assert same.env.args["min_len"] == 2  # the recipe's own env keeps them
