"""Config parsing (text and composite) and validation errors that name the field and value."""

import json

import pytest

from flashnext.config import INDEXED, LINEAR, TextConfig, load_config, parse_config
from flashnext.errors import ConfigError


@pytest.fixture
def make(small_config):
    """`make(**overrides) -> TextConfig` from the shared small config."""
    return lambda **over: TextConfig.from_dict({**small_config, **over})


def test_defaults_and_full_attention_spelling(make):
    cfg = make()
    assert cfg.layer_types == [LINEAR, LINEAR, LINEAR, INDEXED]
    assert cfg.rotary_dim == 4 and cfg.eos_id == 3
    spelled = make(layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"])
    assert spelled.layer_types[2:] == [INDEXED, INDEXED]
    interval = make(full_attention_interval=2, ple_layer_ids=[1])
    assert interval.layer_types == [LINEAR, INDEXED, LINEAR, INDEXED]


def test_composite_and_text_only(tmp_path, make, small_config):
    comp = {"model_type": "qwen4_exp", "text_config": small_config, "vision_config": {"depth": 1}, "image_token_id": 9}
    mc = parse_config(comp)
    assert mc.composite and not mc.language_model_only and mc.text.hidden_size == 16
    assert mc.to_dict()["image_token_id"] == 9
    (tmp_path / "config.json").write_text(json.dumps({**comp, "language_model_only": True}))
    assert load_config(tmp_path).language_model_only
    assert not parse_config({**small_config, "model_type": "qwen4_exp_text"}).composite
    # Round trip keeps the fields.
    assert TextConfig.from_dict(make().to_dict()) == make()


@pytest.mark.parametrize(
    "over, names",
    [
        (dict(ple_layer_ids=[4]), ["ple_layer_ids", "[4]"]),
        (dict(ple_layer_ids=[9]), ["ple_layer_ids", "[9]"]),
        (dict(ple_embed_dim=10), ["ple_embed_dim=10", "4"]),
        (dict(indexer_budget=None), ["indexer_budget"]),
        (dict(indexer_kv_heads=2), ["indexer_kv_heads=2"]),
        (dict(indexer_budget=10), ["indexer_budget=10", "indexer_compress_ratio=4"]),
        (dict(indexer_head_dim=2), ["indexer_head_dim=2", "rotary dim 4"]),
        (dict(eos_token_id=None), ["eos_token_id"]),
        (dict(eos_token_id=[]), ["eos_token_id"]),
        (dict(hc_count=1), ["hc_count=1"]),
        (dict(num_experts=0), ["num_experts=0"]),
        (dict(num_experts_per_tok=5), ["num_experts_per_tok=5"]),
        (dict(output_gate_type="relu"), ["relu"]),
        (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), ["mamba"]),
        (dict(moe_intermediate_size=0), ["moe_intermediate_size=0"]),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_invalid_configs_name_field_and_value(make, over, names):
    with pytest.raises(ConfigError) as err:
        make(**over)
    for n in names:
        assert n in str(err.value), (n, str(err.value))
    assert isinstance(err.value, ValueError)


def test_ple_off_needs_no_eos_and_qsa_off_needs_no_indexed_layers(make):
    cfg = make(ple_layer_ids=[], eos_token_id=None)
    assert cfg.ple_layer_ids == []
    no_qsa = {
        k: None
        for k in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    }
    with pytest.raises(ConfigError, match="indexed_attention"):
        make(**no_qsa)
    make(**no_qsa, layer_types=["linear_attention"] * 4)
