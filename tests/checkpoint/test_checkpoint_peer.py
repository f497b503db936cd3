"""Checkpoints other tools write: `model.state_dict()` saved as is (stacked experts, whole n-gram tables), and
base-model checkpoints (no `lm_head`, no `model.` prefix), which are refused with one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_helpers import assert_same_tensors, build_composite_reference, build_text_reference, headers
from safetensors.torch import save_file
from transformers import Qwen4ExpForCausalLM

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint import layout, load_checkpoint
from flashnext.config import load_config
from flashnext.errors import CheckpointError
from flashnext.model.text import FlashNextForCausalLM

EXPERTS = "model.layers.0.mlp.experts"
TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"


def ours_with_buffers(model) -> dict[str, torch.Tensor]:
    bufs = {k: b for k, b in model.named_buffers() if layout.is_derived_buffer(k)}
    return {**model.state_dict(), **bufs}


def save_state_dict(model, directory, edit=None):
    """What `save_file(model.state_dict())` + `config.save_pretrained` write: the in-memory names, unsplit."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    # A tied head shares the embedding's storage, which safetensors refuses; transformers drops it from the file.
    tied = model.config.get_text_config().tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    if edit is not None:
        edit(state)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize(
    "over", [{}, {"ple_layer_ids": []}, {"tie_word_embeddings": True}], ids=["ple", "no_ple", "tied"]
)
def test_state_dict_layout_loads_tensor_for_tensor(tmp_path, over):
    ref = build_text_reference(seed=3, **over)
    path = save_state_dict(ref, tmp_path / "sd")
    on_disk = headers(path)
    assert f"{EXPERTS}.gate_up_proj" in on_disk and not any(".experts.0." in k for k in on_disk)
    _, info = Qwen4ExpForCausalLM.from_pretrained(path, output_loading_info=True)  # the layout transformers reads
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    model = flashnext.from_pretrained(path)
    assert_same_tensors(ours_with_buffers(model), ref.state_dict())  # a copy per tensor: bitwise
    save_pretrained(model, tmp_path / "ours")  # written back in the official (split) layout
    assert f"{EXPERTS}.0.gate_proj.weight" in headers(tmp_path / "ours")


def test_composite_state_dict_layout_loads(tmp_path):
    ref = build_composite_reference(seed=4)
    path = save_state_dict(ref, tmp_path / "sd")
    assert "model.language_model.layers.0.mlp.experts.down_proj" in headers(path)
    model = flashnext.from_pretrained(path)
    assert model.checkpoint_style == "multimodal"
    assert_same_tensors(ours_with_buffers(model), ref.state_dict())


def _both(state):
    """Keep the stacked experts and add their per-expert split too."""
    gate_up = state[f"{EXPERTS}.gate_up_proj"]
    half = gate_up.shape[1] // 2
    state[f"{EXPERTS}.0.gate_proj.weight"] = gate_up[0, :half].clone()


@pytest.mark.parametrize(
    "edit, problems",
    [
        (_both, [f"duplicate: {EXPERTS}.gate_up_proj is stored both whole and split"]),
        (
            lambda t: t.update({f"{TABLE}.shard_0.weight": t[f"{TABLE}.weight"][:60].clone()}),
            [f"duplicate: {TABLE}.weight is stored both whole and split"],
        ),
        (
            lambda t: t.update({f"{EXPERTS}.down_proj": t[f"{EXPERTS}.down_proj"][:3].clone()}),
            [f"mis-shaped: {EXPERTS}.down_proj is [3, 32, 16] F32, expected [4, 32, 16] floating point"],
        ),
        (
            lambda t: t.pop(f"{EXPERTS}.gate_up_proj"),
            [f"missing: {EXPERTS}.{e}.{p}_proj.weight [16, 32]" for e in range(4) for p in ("gate", "up")],
        ),
    ],
    ids=["experts-both", "table-both", "experts-misshaped", "experts-absent"],
)
def test_state_dict_layout_problems_are_named(tmp_path, edit, problems):
    path = save_state_dict(build_text_reference(seed=5), tmp_path / "sd", edit)
    model = FlashNextForCausalLM(load_config(path).text)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(model, path)
    assert sorted(err.value.problems) == sorted(problems), err.value.problems


def _base_checkpoint(tmp_path, composite: bool):
    ref = build_composite_reference(seed=6) if composite else build_text_reference(seed=6)
    ref.model.save_pretrained(tmp_path / "base")  # Qwen4ExpModel / Qwen4ExpTextModel
    return tmp_path / "base"


@pytest.mark.parametrize("composite", [False, True], ids=["text", "composite"])
def test_base_model_checkpoint_is_one_clear_error(tmp_path, composite):
    path = _base_checkpoint(tmp_path, composite)
    keys = headers(path)
    assert not any(k.startswith(("model.", "lm_head.")) for k in keys)
    cls = "Qwen4ExpModel" if composite else "Qwen4ExpTextModel"
    assert json.loads((path / "config.json").read_text())["architectures"] == [cls]
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(path)
    msg = str(err.value)
    assert err.value.problems == [] and msg.count("\n") == 0, msg  # one sentence, not ~200 key problems
    assert f"base-model checkpoint ({cls}.save_pretrained" in msg and "without lm_head.weight" in msg
    assert str(path) in msg
