"""Composite (`qwen4_exp`) checkpoints: text weights under `model.language_model.*`, vision and mtp kept aside."""

from __future__ import annotations

import json

import torch
from ckpt_helpers import assert_same_tensors, build_composite_reference, headers, rewrite
from safetensors.torch import load_file
from transformers import Qwen4ExpForConditionalGeneration

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint import layout, load_checkpoint
from flashnext.config import load_config
from flashnext.model.multimodal import FlashNextForConditionalGeneration
from flashnext.model.text import FlashNextForCausalLM

MTP = {
    "mtp.fc.weight": torch.randn(32, 64),
    "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(16, 32).to(torch.bfloat16),
    "mtp.norm.weight": torch.randn(32),
}


def text_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference composite's text tensors under our names."""
    out = {}
    for k, v in state.items():
        if k.startswith("model.language_model."):
            out["model." + k.removeprefix("model.language_model.")] = v
        elif k.startswith("lm_head."):
            out[k] = v
    return out


def ours_with_buffers(model) -> dict[str, torch.Tensor]:
    bufs = {k: b for k, b in model.named_buffers() if layout.is_derived_buffer(k)}
    return {**model.state_dict(), **bufs}


def test_composite_with_vision_and_mtp(tmp_path):
    ref = build_composite_reference()
    ref.save_pretrained(tmp_path / "ref")
    rewrite(tmp_path / "ref" / "model.safetensors", lambda t: t.update(MTP))
    on_disk = load_file(tmp_path / "ref" / "model.safetensors")

    model = flashnext.from_pretrained(tmp_path / "ref")
    assert isinstance(model, FlashNextForConditionalGeneration)
    assert model.checkpoint_style == "multimodal" and model.model_config.composite
    # The composite model keeps the reference's in-memory names, vision tower included.
    assert_same_tensors(ours_with_buffers(model), ref.state_dict())
    assert any(k.startswith("model.visual.") for k in model.state_dict())
    extra = {k: v for k, v in on_disk.items() if k.startswith("mtp.")}
    assert_same_tensors(model.extra_tensors, extra)  # stored dtype kept (bf16 mtp stays bf16)

    save_pretrained(model, tmp_path / "ours")
    assert headers(tmp_path / "ours") == headers(tmp_path / "ref")
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert cfg["model_type"] == "qwen4_exp" and cfg["vision_config"]["depth"] == 1
    assert_same_tensors(load_file(tmp_path / "ours" / "model.safetensors"), on_disk)

    back, info = Qwen4ExpForConditionalGeneration.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert_same_tensors(back.state_dict(), ref.state_dict())


def test_language_model_only_composite(tmp_path):
    ref = build_composite_reference(seed=1, ple_layer_ids=[1, 2])
    ref.save_pretrained(tmp_path / "ref")
    rewrite(
        tmp_path / "ref" / "model.safetensors",
        lambda t: [t.pop(k) for k in list(t) if k.startswith("model.visual.")],
    )
    cfg_path = tmp_path / "ref" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "language_model_only": True}))

    model = flashnext.from_pretrained(tmp_path / "ref")
    assert model.model_config.language_model_only
    assert model.extra_tensors == {}
    assert_same_tensors(ours_with_buffers(model), text_part(ref.state_dict()))

    save_pretrained(model, tmp_path / "ours")
    assert headers(tmp_path / "ours") == headers(tmp_path / "ref")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["language_model_only"] is True
    again = flashnext.from_pretrained(tmp_path / "ours")
    assert_same_tensors(ours_with_buffers(again), text_part(ref.state_dict()))


def test_text_model_reads_composite_keeping_visual_aside(tmp_path):
    """The text model alone can still read a composite checkpoint: `model.visual.*` goes to extra_tensors."""
    ref = build_composite_reference(seed=2)
    ref.save_pretrained(tmp_path / "ref")
    on_disk = load_file(tmp_path / "ref" / "model.safetensors")
    cfg = load_config(tmp_path / "ref")
    model = FlashNextForCausalLM(cfg.text)
    model.model_config = cfg
    load_checkpoint(model, tmp_path / "ref")
    assert model.checkpoint_style == "composite"
    assert_same_tensors(ours_with_buffers(model), text_part(ref.state_dict()))
    visual = {k: v for k, v in on_disk.items() if k.startswith("model.visual.")}
    assert visual and set(model.extra_tensors) == set(visual)
    save_pretrained(model, tmp_path / "ours")
    assert headers(tmp_path / "ours") == headers(tmp_path / "ref")
