"""The QSA layers' spelling in `layer_types` survives a round trip: a model loaded from a config that says
`full_attention` (the official checkpoints, llama.cpp's converter reads only that) is saved with `full_attention`,
one that says `indexed_attention` with that; `flashnext convert --layer-type-spelling` writes either."""

from __future__ import annotations

import json

import pytest
import torch

from flashnext import from_pretrained, save_pretrained
from flashnext.build import build_model
from flashnext.checkpoint import training
from flashnext.cli import main
from flashnext.config import INDEXED, LINEAR, parse_config, tiny_config_dict

SPELLINGS = ["full_attention", "indexed_attention"]


def _config(spelling: str) -> dict:
    raw = tiny_config_dict()
    raw["layer_types"] = [t if t == LINEAR else spelling for t in raw["layer_types"]]
    return raw


def _written(path) -> list[str]:
    return json.loads((path / "config.json").read_text())["layer_types"]


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_save_writes_the_spelling_it_loaded(tmp_path, spelling):
    cfg = parse_config(_config(spelling))
    assert cfg.text.layer_types[-1] == INDEXED  # the model reads one spelling either way
    assert cfg.to_dict()["layer_types"] == _config(spelling)["layer_types"]
    save_pretrained(build_model(cfg, seed=0), tmp_path / "a")
    assert _written(tmp_path / "a") == _config(spelling)["layer_types"]
    save_pretrained(from_pretrained(tmp_path / "a"), tmp_path / "b")  # loaded, then saved again
    assert _written(tmp_path / "b") == _config(spelling)["layer_types"]


def test_generated_layer_types_keep_the_indexed_spelling():
    raw = {k: v for k, v in tiny_config_dict().items() if k != "layer_types"}
    assert parse_config(raw).to_dict()["layer_types"][-1] == "indexed_attention"


@pytest.mark.parametrize("loaded", SPELLINGS)
@pytest.mark.parametrize("wanted", [None, *SPELLINGS])
def test_convert_writes_the_spelling_asked_for(tmp_path, loaded, wanted):
    cfg = parse_config(_config(loaded))
    model = build_model(cfg, seed=0)
    meta = {"step": 1, "model_config": cfg.to_dict(), "run_config": {}}
    ckpt = training.save(tmp_path / "checkpoints", 1, {"model": model.state_dict()}, meta, keep_last=1)
    flag = [] if wanted is None else ["--layer-type-spelling", wanted]
    assert main(["convert", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), *flag]) == 0
    assert _written(tmp_path / "hf")[-1] == (wanted or loaded)
    back = from_pretrained(tmp_path / "hf")
    assert back.config.layer_types == cfg.text.layer_types
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
