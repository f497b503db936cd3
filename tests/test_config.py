"""Config parsing (text and composite) and validation errors that name the field and value."""

import dataclasses
import json

import pytest

from flashnext.config import (
    BOOL,
    INDEXED,
    LINEAR,
    TEXT_FIELDS,
    VISION_FIELDS,
    TextConfig,
    VisionConfig,
    load_config,
    parse_config,
)
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
        (dict(hc_count=1), ["hc_count", "got 1"]),
        (dict(num_experts=0), ["num_experts", "got 0"]),
        (dict(num_experts_per_tok=5), ["num_experts_per_tok=5"]),
        (dict(output_gate_type="relu"), ["relu"]),
        (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), ["mamba"]),
        (dict(moe_intermediate_size=0), ["moe_intermediate_size", "got 0"]),
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


# ---- every field's type and range, from config.json files ------------------------------------------------------
def _composite(small_config, text=None, vision=None, **top):
    vision = {"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 16, **(vision or {})}
    return {"model_type": "qwen4_exp", "text_config": {**small_config, **(text or {})}, "vision_config": vision, **top}


BAD_FILES = {
    # name: (config.json text, or a function of the small config returning an object; needles in the message)
    "corrupt-json": ('{"vocab_size": 64,', ["not valid JSON", "line 1 column 19"]),
    "json-list": ("[1, 2]", ["must be a JSON object", "a JSON array"]),
    "json-string": ('"qwen"', ["must be a JSON object", "a string"]),
    "vocab-negative": (lambda c: {**c, "vocab_size": -5}, ["vocab_size must be a positive int, got -5"]),
    "kv-heads-zero": (lambda c: {**c, "num_key_value_heads": 0}, ["num_key_value_heads must be a positive int, got 0"]),
    "hidden-string": (lambda c: {**c, "hidden_size": "64"}, ["hidden_size must be a positive int, got '64'"]),
    "hidden-float": (lambda c: {**c, "hidden_size": 16.0}, ["hidden_size must be a positive int, got 16.0"]),
    "hidden-bool": (lambda c: {**c, "hidden_size": True}, ["hidden_size must be a positive int, got True"]),
    "eps-nan": (lambda c: {**c, "rms_norm_eps": float("nan")}, ["rms_norm_eps must be a positive finite", "nan"]),
    "eps-inf": (lambda c: {**c, "rms_norm_eps": float("inf")}, ["rms_norm_eps", "got inf"]),
    "heads-not-multiple": (
        lambda c: {**c, "num_attention_heads": 3, "num_key_value_heads": 2},
        ["num_attention_heads=3 is not a multiple of num_key_value_heads=2"],
    ),
    "linear-heads": (
        lambda c: {**c, "linear_num_value_heads": 3, "linear_num_key_heads": 2},
        ["linear_num_value_heads=3"],
    ),
    "experts-per-tok": (
        lambda c: {**c, "num_experts_per_tok": 0},
        ["num_experts_per_tok must be a positive int, got 0"],
    ),
    "layer-type-int": (lambda c: {**c, "layer_types": ["linear_attention"] * 3 + [4]}, ["layer_types must be a list"]),
    "layer-types-string": (lambda c: {**c, "layer_types": "linear_attention"}, ["layer_types", "'linear_attention'"]),
    "eos-negative": (lambda c: {**c, "eos_token_id": [3, -1]}, ["eos_token_id must be", "got [3, -1]"]),
    "pad-string": (lambda c: {**c, "pad_token_id": "0"}, ["pad_token_id must be a non-negative int or null"]),
    "ple-ids-string": (lambda c: {**c, "ple_layer_ids": "2"}, ["ple_layer_ids must be a list of ints"]),
    "hidden-act": (lambda c: {**c, "hidden_act": "gelu"}, ["hidden_act must be one of ['silu'], got 'gelu'"]),
    "dropout-one": (lambda c: {**c, "attention_dropout": 1.0}, ["attention_dropout must be a number in [0, 1)"]),
    "seed-float": (lambda c: {**c, "seed": 1.5}, ["seed must be an int, got 1.5"]),
    "tie-string": (lambda c: {**c, "tie_word_embeddings": "false"}, ["tie_word_embeddings must be true or false"]),
    "indexer-zero": (lambda c: {**c, "indexer_budget": 0}, ["indexer_budget must be a positive int or null, got 0"]),
    "rope-not-object": (lambda c: {**c, "rope_parameters": [1e4]}, ["rope_parameters must be an object or null"]),
    "rope-theta": (
        lambda c: {**c, "rope_parameters": {"rope_theta": -1.0}},
        ["rope_parameters.rope_theta must be a positive finite number, got -1.0"],
    ),
    "rope-factor": (
        lambda c: {**c, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}},
        ["rope_parameters.partial_rotary_factor must be a number in (0, 1], got 1.5"],
    ),
    "rope-type-yarn": (
        lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
        ["rope_parameters.rope_type must be one of ['default'], got 'yarn'"],
    ),
    "rope-scaling-legacy": (lambda c: {**c, "rope_scaling": {"type": "linear"}}, ["rope_type", "got 'linear'"]),
    "mrope-section": (
        lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "mrope_section": [2, 2]}},
        ["rope_parameters.mrope_section must be a list of length 3"],
    ),
    "rotary-odd": (lambda c: {**c, "head_dim": 6}, ["rotary dim 3", "positive even"]),
    "model-type": (lambda c: {**c, "model_type": "llama"}, ["model_type='llama'"]),
    "composite-text": (
        lambda c: _composite(c, text={"num_key_value_heads": 0}),
        ["text_config: num_key_value_heads must be a positive int, got 0"],
    ),
    "composite-text-list": (
        lambda c: {**_composite(c), "text_config": [c]},
        ["text_config must be an object"],
    ),
    "composite-no-text": (lambda c: {"model_type": "qwen4_exp"}, ["needs a text_config object"]),
    "composite-vision-heads": (
        lambda c: _composite(c, vision={"num_heads": 0}),
        ["vision_config.num_heads must be a positive int, got 0"],
    ),
    "composite-vision-list": (lambda c: {**_composite(c), "vision_config": [1]}, ["vision_config must be an object"]),
    "composite-vision-rope": (
        lambda c: _composite(c, vision={"rope_parameters": {"rope_type": "axial", "rope_theta": 0}}),
        ["vision_config.rope_parameters.rope_theta must be a positive finite number, got 0"],
    ),
    "composite-image-token": (lambda c: _composite(c, image_token_id=-1), ["image_token_id must be a non-negative"]),
    "composite-lm-only": (lambda c: _composite(c, language_model_only="yes"), ["language_model_only must be true"]),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_bad_config_json_names_file_and_field(tmp_path, small_config, name):
    content, needles = BAD_FILES[name]
    text = content if isinstance(content, str) else json.dumps(content(small_config))
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: "), msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_unreadable_config_json_names_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"vocab_size": "\xff"}')
    with pytest.raises(ConfigError, match="config.json: cannot read .*UnicodeDecodeError"):
        load_config(tmp_path)


@pytest.mark.parametrize("name", sorted(TEXT_FIELDS))
def test_every_text_field_rejects_a_wrong_type(make, name):
    """The table covers each field: a string where nothing takes "bogus", a bool where no field takes one."""
    for bad in ("bogus", True) if TEXT_FIELDS[name] is not BOOL else ("bogus", 1):
        with pytest.raises(ConfigError, match=f"^{name} must be .*, got {bad!r}$"):
            make(**{name: bad})


@pytest.mark.parametrize("name", sorted(VISION_FIELDS))
def test_every_vision_field_rejects_a_wrong_type(small_config, name):
    comp = _composite(small_config)
    parse_config(comp)  # the base is valid
    comp["vision_config"][name] = "bogus" if name != "rope_theta" else None
    if name == "rope_theta":  # read from rope_parameters, as in the reference
        comp["vision_config"]["rope_parameters"] = {"rope_theta": "bogus"}
    with pytest.raises(ConfigError, match=f"vision_config\\..*{name} must be "):
        parse_config(comp)


def test_tables_cover_every_field():
    text = {f.name for f in dataclasses.fields(TextConfig)} - {"extra"}
    assert set(TEXT_FIELDS) == text
    assert set(VISION_FIELDS) == {f.name for f in dataclasses.fields(VisionConfig)}


def test_language_model_only_skips_the_unused_vision_config(small_config):
    parse_config(_composite(small_config, vision={"num_heads": 0}, language_model_only=True))
    vision_rope_default = _composite(small_config, vision={"rope_parameters": {"rope_type": "default"}})
    assert parse_config(vision_rope_default).vision_config.rope_theta == 10000.0  # "default" reads as axial


# ---- rope fields at the top level (older configs) --------------------------------------------------------------
@pytest.mark.parametrize(
    "rope, top, theta, factor",
    [
        ({"rope_type": "default"}, {"rope_theta": 5e5, "partial_rotary_factor": 0.25}, 5e5, 0.25),
        (None, {"rope_theta": 5e5, "partial_rotary_factor": 0.25}, 5e5, 0.25),
        ({"rope_theta": 5e5}, {"rope_theta": 10.0, "partial_rotary_factor": 0.25}, 5e5, 0.25),  # rope_parameters wins
        ({"partial_rotary_factor": 0.5}, {"partial_rotary_factor": 1.0}, 1e4, 0.5),
        ({"type": "default", "rope_theta": 7.0}, {}, 7.0, 1.0),  # legacy "type" key
    ],
)
def test_top_level_rope_fields_merge_into_rope_parameters(small_config, rope, top, theta, factor):
    data = {k: v for k, v in small_config.items() if k != "rope_parameters"}
    data.update(top)
    if rope is not None:
        data["rope_parameters"] = rope
    cfg = TextConfig.from_dict(data)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (theta, factor)
    assert cfg.rope_parameters["rope_type"] == "default"
    assert not {"rope_theta", "partial_rotary_factor"} & set(cfg.to_dict()) - {"rope_parameters"}
    assert "rope_theta" not in cfg.extra and TextConfig.from_dict(cfg.to_dict()) == cfg
    assert data.get("rope_parameters") == rope  # the caller's dict is not modified


# ---- MTP (the draft head): three spellings of its layer count ------------------------------------------------
@pytest.mark.parametrize(
    "spelling",
    [{"mtp_num_hidden_layers": 1}, {"num_nextn_predict_layers": 1}, {"mtp": {"num_hidden_layers": 1, "hybrid": True}}],
    ids=["mtp_num_hidden_layers", "num_nextn_predict_layers", "nested"],
)
def test_mtp_spellings_parse_and_round_trip(make, spelling):
    cfg = make(**spelling)
    assert cfg.mtp_layers == 1
    out = cfg.to_dict()
    assert {k: out[k] for k in spelling} == spelling  # written back in the spelling given, and only that one
    others = {"mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp"} - set(spelling)
    assert not others & set(out)
    assert TextConfig.from_dict(out) == cfg


def test_mtp_absent_or_zero_means_no_head(make):
    assert make().mtp_layers == 0 and "mtp" not in make().to_dict()
    assert make(mtp_num_hidden_layers=0).mtp_layers == 0


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(mtp_num_hidden_layers=1, num_nextn_predict_layers=2), "given differently by"),
        (dict(num_nextn_predict_layers=2), r"^num_nextn_predict_layers=2: only one MTP layer is supported$"),
        (dict(mtp={"num_hidden_layers": "one"}), r"^mtp\.num_hidden_layers must be a non-negative int, got 'one'$"),
        (dict(mtp={"num_hidden_layers": 1, "layer_types": ["linear_attention"]}), r"^mtp\.layer_types must be a"),
        (dict(mtp={"num_hidden_layers": 1, "rope_theta": 1e7}), r"mtp\.rope_theta=10000000.0 differs from"),
        (dict(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings=true"),
        (
            dict(
                mtp_num_hidden_layers=1,
                **dict.fromkeys(
                    (
                        "indexer_n_heads",
                        "indexer_kv_heads",
                        "indexer_head_dim",
                        "indexer_budget",
                        "indexer_compress_ratio",
                    )
                ),
                layer_types=["linear_attention"] * 4,
            ),
            "mtp_num_hidden_layers=1: the MTP layer is a QSA attention layer",
        ),
    ],
    ids=["disagree", "two-layers", "nested-type", "nested-layer-type", "rope-theta", "dedicated-embed", "no-qsa"],
)
def test_mtp_config_errors_name_the_field(make, over, message):
    with pytest.raises(ConfigError, match=message):
        make(**over)
    assert make(mtp={"num_hidden_layers": 1, "rope_theta": 1e4, "layer_types": ["full_attention"]}).mtp_layers == 1


def test_the_shipped_recipes_leave_threads_to_the_command():
    """`flashnext rl` warm-starts from tiny-sft.toml: both recipes run with the command's thread default (every core,
    OpenMP threads that sleep while they wait: `cli/_env.py`), which `benchmarks/threads_under_load.py` measured as
    the fastest on a busy box; a recipe pinning its own count would undo that for the one run a new user starts."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    recipes = {p.name: tomllib.loads(p.read_text())["train"] for p in root.glob("tiny-*.toml")}
    assert set(recipes) >= {"tiny-sft.toml", "tiny-rl.toml"}, recipes
    assert {name: t["threads"] for name, t in recipes.items() if "threads" in t} == {}


def test_the_shipped_sft_recipe_trains_the_draft_head():
    """Serving the tiny SFT recipe's model with speculative decoding needs a trained MTP head (an untrained one
    accepts ~2% of drafts); `flashnext rl` warm-starts from the same run."""
    from pathlib import Path

    from flashnext.train.config import load_run_config
    from flashnext.train.setup import model_text_config

    cfg = load_run_config(Path(__file__).resolve().parents[1] / "configs" / "tiny-sft.toml")
    assert cfg.train.mtp_loss_weight > 0 and model_text_config(cfg).mtp_layers == 1
