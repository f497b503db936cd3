"""The MTP head in checkpoints: official `mtp.*` keys, exact round trip, transformers still loads ours, and the
checkpoints other tools write (config with MTP but no weights, an unused mixer inject, a head of its own)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from ckpt_helpers import headers, randomize, rewrite, tiny_text

import flashnext
from flashnext import save_pretrained
from flashnext.config import ModelConfig, parse_config
from flashnext.errors import CheckpointError
from flashnext.model.text import FlashNextForCausalLM


def _model(**over) -> FlashNextForCausalLM:
    return randomize(FlashNextForCausalLM(parse_config(tiny_text(mtp_num_hidden_layers=1, **over)).text), 3).eval()


def test_round_trip_is_exact_with_official_keys(tmp_path):
    model = _model()
    save_pretrained(model, tmp_path)
    keys = {k for k in headers(tmp_path) if k.startswith("mtp.")}
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in keys  # per-expert on disk, as the trunk's
    assert "mtp.pre_fc_norm_hidden.weight" in keys and "mtp.fc_embedding.weight" in keys
    assert headers(tmp_path)["mtp.pre_fc_norm_hidden.weight"][0] == (2 * 32,)  # one norm over hc * D
    assert len(keys) == 31 - 2 + 3 * 4  # 31 names; the 2 stacked expert tensors are 3 x 4 per-expert ones
    loaded = flashnext.from_pretrained(tmp_path)
    assert loaded.mtp is not None and loaded.extra_tensors == {}
    ours, back = model.state_dict(), loaded.state_dict()
    assert set(ours) == set(back) and all(torch.equal(ours[k], back[k]) for k in ours)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_transformers_loads_our_checkpoint_with_mtp(tmp_path):
    """transformers has no MTP module: it ignores `mtp.*` on load and reads the trunk we wrote, unchanged."""
    from transformers import Qwen4ExpForCausalLM

    model = _model()
    save_pretrained(model, tmp_path)
    ref = Qwen4ExpForCausalLM.from_pretrained(tmp_path).eval()
    ref_sd, ours = ref.state_dict(), model.state_dict()
    assert not any(k.startswith("mtp.") for k in ref_sd)
    trunk = [k for k in ours if not k.startswith("mtp.")]
    assert all(torch.equal(ref_sd[k], ours[k]) for k in trunk)  # same names in memory (see checkpoint/layout.py)


def test_composite_text_only_checkpoint_keeps_mtp_at_top_level(tmp_path):
    model = _model()
    cfg = ModelConfig(text=model.config, composite=True, language_model_only=True, top={"language_model_only": True})
    flashnext.checkpoint.save_pretrained(model, tmp_path, config=cfg)
    keys = headers(tmp_path)
    assert "mtp.fc_hidden.weight" in keys and "model.language_model.embed_tokens.weight" in keys
    loaded = flashnext.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.mtp.parameters(), loaded.mtp.parameters(), strict=True))


def test_config_with_mtp_but_no_weights_loads_without_the_head(tmp_path, caplog):
    """What converters that drop `mtp.*` (and keep the config) write: the trunk loads, without a draft head."""
    model = _model()
    save_pretrained(model, tmp_path)
    rewrite(tmp_path / "model.safetensors", lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")])
    with caplog.at_level(logging.WARNING, logger="flashnext"):
        loaded = flashnext.from_pretrained(tmp_path)
    assert loaded.mtp is None and "no mtp.* weights are stored" in caplog.text
    assert len(loaded.state_spec(16)) == model.config.num_hidden_layers


def test_some_mtp_weights_missing_is_refused(tmp_path):
    model = _model()
    save_pretrained(model, tmp_path)
    rewrite(tmp_path / "model.safetensors", lambda t: t.pop("mtp.fc_hidden.weight"))
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(tmp_path)
    assert err.value.problems == ["missing: mtp.fc_hidden.weight [32, 32]"]


def test_mtp_tensors_without_config_stay_extra(tmp_path):
    """A config without MTP keeps the checkpoint's `mtp.*` as opaque extra tensors, written back as they were."""
    model = _model()
    save_pretrained(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    del cfg["mtp_num_hidden_layers"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    plain = flashnext.from_pretrained(tmp_path / "a")
    assert plain.mtp is None and "mtp.fc_hidden.weight" in plain.extra_tensors
    save_pretrained(plain, tmp_path / "b")
    assert headers(tmp_path / "a") == headers(tmp_path / "b")


def test_mixer_inject_dropped_and_own_head_used(tmp_path):
    """`mtp.hyper_connection_mixer.block_inject_weight` (the head's mixer injects nothing) is kept aside, unused;
    `mtp.shared_head.head.weight`, when present, is the draft head's LM head instead of the shared `lm_head`."""
    model = _model()
    save_pretrained(model, tmp_path)
    own = torch.randn(128, 32, generator=torch.Generator().manual_seed(9))

    def add(t):
        t["mtp.hyper_connection_mixer.block_inject_weight"] = torch.randn(2, 64)
        t["mtp.shared_head.head.weight"] = own

    rewrite(tmp_path / "model.safetensors", add)
    loaded = flashnext.from_pretrained(tmp_path)
    extras = {"mtp.hyper_connection_mixer.block_inject_weight", "mtp.shared_head.head.weight"}
    assert set(loaded.extra_tensors) == extras
    assert torch.equal(loaded.mtp_head_weight(), own) and torch.equal(model.mtp_head_weight(), model.lm_head.weight)
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(ids, return_mtp=True).mtp_logits
        b = loaded(ids, return_mtp=True).mtp_logits
    assert (a - b).abs().max() > 1e-2  # the head of its own changes the draft logits


def test_composite_with_vision_loads_its_mtp_head(tmp_path):
    """A composite checkpoint (vision tower) whose config declares an MTP layer: the head is built and loaded as
    parameters (not kept aside), round-trips exactly, and transformers still loads the checkpoint."""
    from ckpt_helpers import TINY_VISION
    from transformers import Qwen4ExpForConditionalGeneration

    from flashnext.model.multimodal import FlashNextForConditionalGeneration

    raw = dict(model_type="qwen4_exp", text_config=tiny_text(mtp_num_hidden_layers=1), vision_config=TINY_VISION)
    model = randomize(FlashNextForConditionalGeneration(parse_config(raw)), 4).eval()
    save_pretrained(model, tmp_path)
    assert "mtp.fc_hidden.weight" in headers(tmp_path) and "model.visual.pos_embed.weight" in headers(tmp_path)
    loaded = flashnext.from_pretrained(tmp_path)
    assert isinstance(loaded, FlashNextForConditionalGeneration) and loaded.mtp is not None
    assert loaded.extra_tensors == {}
    ours, back = model.state_dict(), loaded.state_dict()
    assert set(ours) == set(back) and all(torch.equal(ours[k], back[k]) for k in ours)
    ref = Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path)
    assert not any(k.startswith("mtp.") for k in ref.state_dict())
