"""Validation: one CheckpointError lists every bad key or file, raised before any parameter is written."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import build_text_reference, rewrite

from flashnext.checkpoint import load_checkpoint
from flashnext.config import load_config
from flashnext.errors import CheckpointError
from flashnext.model.text import FlashNextForCausalLM

PLE = "model.layers.1.ple.ple_embedding"


def sentinel_model(directory) -> FlashNextForCausalLM:
    model = FlashNextForCausalLM(load_config(directory).text)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


def untouched(model) -> bool:
    return all(bool((p == 7.0).all()) for p in model.parameters())


@pytest.fixture
def ckpt(tmp_path):
    build_text_reference().save_pretrained(tmp_path / "ref")
    return tmp_path / "ref"


def test_every_bad_key_in_one_error(ckpt):
    def damage(t):
        del t["model.layers.0.mlp.gate.weight"]  # missing
        del t[f"{PLE}.ngram_embedding.shard_2.weight"]  # missing n-gram shard
        t["model.layers.0.mlp.bogus.weight"] = torch.zeros(2, 2)  # unexpected
        t["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(17, 32)  # mis-shaped
        t["model.embed_tokens.weight"] = torch.zeros(128, 32, dtype=torch.int32)  # not floating point

    rewrite(ckpt / "model.safetensors", damage)
    model = sentinel_model(ckpt)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, ckpt)
    assert isinstance(err.value, ValueError)
    problems = "\n".join(err.value.problems)
    assert len(err.value.problems) == 5, problems
    for needle in (
        "missing: model.layers.0.mlp.gate.weight",
        f"missing: {PLE}.ngram_embedding.shard_2.weight (shards present: [0, 1, 3])",
        "unexpected: model.layers.0.mlp.bogus.weight",
        "mis-shaped: model.layers.1.mlp.experts.2.up_proj.weight is [17, 32] F32, expected [16, 32]",
        "wrong dtype: model.embed_tokens.weight is [128, 32] I32, expected floating point",
    ):
        assert needle in problems and needle in str(err.value)
    assert untouched(model)


def test_truncated_and_absent_shards_are_named(tmp_path):
    build_text_reference().save_pretrained(tmp_path / "ref", max_shard_size="40KB")
    shards = sorted((tmp_path / "ref").glob("model-*.safetensors"))
    assert len(shards) >= 3
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) - 1000])  # truncated mid-tensor
    shards[2].unlink()
    model = sentinel_model(tmp_path / "ref")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, tmp_path / "ref")
    assert f"missing file: {shards[2].name}" in str(err.value)
    model_ok = sentinel_model(tmp_path / "ref")
    shards[2].write_bytes(b"")  # present but empty: unreadable, not missing
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model_ok, tmp_path / "ref")
    msg = str(err.value)
    assert f"unreadable file: {shards[1].name}" in msg and f"unreadable file: {shards[2].name}" in msg
    assert len(err.value.problems) == 2, msg  # their keys are not listed again as "missing"
    assert untouched(model) and untouched(model_ok)


def test_truncated_single_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable file: model.safetensors"):
        load_checkpoint(sentinel_model(ckpt), ckpt)


def test_derived_buffer_mismatch(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: t[f"{PLE}.layer_multipliers"].add_(2))
    model = sentinel_model(ckpt)
    with pytest.raises(CheckpointError, match=f"mismatch: {PLE}.layer_multipliers"):
        load_checkpoint(model, ckpt)
    assert untouched(model)


def test_derived_buffers_may_be_absent(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: [t.pop(k) for k in list(t) if k.startswith(f"{PLE}.ngram_heads")])
    model = sentinel_model(ckpt)
    load_checkpoint(model, ckpt)
    assert not untouched(model)


def test_wrong_layout_and_arguments(ckpt, tmp_path):
    model = sentinel_model(ckpt)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, ckpt, prefix_style="composite")
    assert "unexpected: model.embed_tokens.weight" in str(err.value)
    assert "missing: model.language_model.embed_tokens.weight" in str(err.value)
    with pytest.raises(CheckpointError, match="prefix_style='vision'"):
        load_checkpoint(model, ckpt, prefix_style="vision")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(model, tmp_path)
    assert untouched(model)
