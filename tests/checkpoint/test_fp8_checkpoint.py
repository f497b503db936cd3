"""The official FP8 checkpoint: `quantize --weights fp8` writes it, `from_pretrained` keeps its routed experts in
block FP8, `save_pretrained` writes it back byte for byte, and what we cannot load exactly is refused by key.
(transformers' reading of the same files: `tests/reference/test_fp8_checkpoint_vs_transformers.py`.)"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from ckpt_helpers import rewrite
from safetensors import safe_open

import flashnext
from flashnext import save_pretrained
from flashnext.checkpoint.quantize_weights import quantize_weights
from flashnext.cli import main as cli_main
from flashnext.config import parse_config
from flashnext.errors import CheckpointError
from flashnext.model.quant_experts_fp8 import Fp8Experts, reference_experts
from flashnext.model.text import FlashNextForCausalLM
from flashnext.ops.fp8_blocks import dequantize_blocks

EXPERT = "model.layers.0.mlp.experts.1"
TABLE = "model.layers.1.ple.ple_embedding.ngram_embedding"


def _tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, small_config_module):
    """(bf16 source dir, its `quantize --weights fp8` copy): experts gate/up [128, 256] (grid [1, 2]), down
    [256, 128] (grid [2, 1]), a 3-shard n-gram table, two files + index."""
    root = tmp_path_factory.mktemp("fp8")
    cfg = parse_config(dict(small_config_module, hidden_size=256, moe_intermediate_size=128, split_ngram_parts=3))
    model = FlashNextForCausalLM(cfg.text).eval()
    model.init_weights(0)
    save_pretrained(model.to(torch.bfloat16), root / "bf16", max_shard_bytes=300_000)
    (root / "bf16" / "tokenizer_config.json").write_text("{}\n")
    quantize_weights(root / "bf16", root / "fp8")
    return root / "bf16", root / "fp8"


def _copy(checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoints[1], dst)
    return dst


def test_quantize_writes_the_official_layout(checkpoints):
    src, dst = checkpoints
    before, after = _tensors(src), _tensors(dst)
    experts = {k for k in before if ".mlp.experts." in k}
    assert len(experts) == 4 * 4 * 3
    for key in experts:
        scale = after[key.removesuffix(".weight") + ".weight_scale_inv"]
        assert after[key].dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16
        assert scale.shape == ((1, 2) if "down_proj" not in key else (2, 1))
        # E4M3: 3 mantissa bits (2^-4 relative) above the subnormals, below them half a step of 2^-10 x scale.
        scale_full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        err = (dequantize_blocks(after[key], scale, torch.float32) - before[key].float()).abs()
        assert (err <= torch.maximum(before[key].float().abs() * 2**-4, scale_full * 2**-10)).all(), key
    shards = [k for k in before if k.startswith(f"{TABLE}.shard_")]
    assert len(shards) == 3 and all(after[k].dtype == torch.float8_e4m3fn for k in shards)
    assert after[f"{TABLE}.weight_scale"].dtype == torch.bfloat16 and after[f"{TABLE}.weight_scale"].shape == (1,)
    for key in set(before) - experts - set(shards):
        assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert {k: qcfg[k] for k in ("quant_method", "activation_scheme", "weight_block_size", "modules_to_convert")} == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_convert": ["ple.ple_embedding.ngram_embedding"]}  # fmt: skip
    skip = set(qcfg["modules_to_not_convert"])
    assert {"lm_head", "model.embed_tokens", "model.layers.3.self_attn.q_proj", "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.linear_attn.in_proj_qkv"} <= skip
    assert not {m for m in skip if ".experts." in m or "ngram" in m}
    assert (dst / "tokenizer_config.json").read_text() == "{}\n"
    assert json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"].keys() == after.keys()


def test_fp8_checkpoint_keeps_experts_in_fp8_and_matches_the_dequantised_model(checkpoints):
    model = flashnext.from_pretrained(checkpoints[1])
    on_disk = _tensors(checkpoints[1])
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
        pre = f"model.layers.{i}.mlp.experts.1"
        up = on_disk[f"{pre}.up_proj.weight"]
        assert torch.equal(experts.gate_up_proj[1, 128:].view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(experts.down_proj_scale_inv[1], on_disk[f"{pre}.down_proj.weight_scale_inv"])
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        layer.mlp.experts = reference_experts(layer.mlp.experts)
    ids = torch.randint(4, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, want = model(ids).logits, twin(ids).logits
    # The same dequantised weights (bitwise); only the grouped GEMMs' shapes differ (the touched experts vs all
    # of them): fp32 rounding.
    assert (ours - want).abs().max() <= 1e-5 * want.abs().max()


def test_save_writes_the_fp8_checkpoint_back_byte_for_byte(checkpoints, tmp_path):
    model = flashnext.from_pretrained(checkpoints[1], dtype=torch.bfloat16)
    save_pretrained(model, tmp_path / "again")
    before, after = _tensors(checkpoints[1]), _tensors(tmp_path / "again")
    assert before.keys() == after.keys()
    bad = [k for k in before if before[k].dtype != after[k].dtype
           or not torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))]  # fmt: skip
    assert not bad, bad
    read = lambda d: json.loads((d / "config.json").read_text())["quantization_config"]  # noqa: E731
    assert read(tmp_path / "again") == read(checkpoints[1])


def _refused(directory, *fragments):
    with pytest.raises(CheckpointError) as err:
        flashnext.from_pretrained(directory)
    text = str(err.value) + "\n".join(err.value.problems or [])
    assert all(f in text for f in fragments), text


def _edit(directory, key, edit):
    """Apply `edit(tensors)` to the file of `directory` holding `key`."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    rewrite(directory / index[key], edit)
    return index[key]


def test_refuses_an_fp8_expert_without_its_scale(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    _edit(d, f"{EXPERT}.up_proj.weight_scale_inv", lambda t: t.pop(f"{EXPERT}.up_proj.weight_scale_inv"))
    _refused(d, f"missing: {EXPERT}.up_proj.weight_scale_inv", f"F8_E4M3 weight {EXPERT}.up_proj.weight")


def test_refuses_a_scale_grid_that_does_not_match_the_blocks(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    key = f"{EXPERT}.down_proj.weight_scale_inv"
    _edit(d, key, lambda t: t.__setitem__(key, torch.ones(2, 2, dtype=torch.bfloat16)))
    _refused(d, f"mis-shaped: {key} is [2, 2], expected [2, 1]")


def test_refuses_an_unimplemented_block_size(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, "quantization_config.weight_block_size=[64, 64]", "[128, 128]")


def test_refuses_e5m2(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    key = f"{EXPERT}.gate_proj.weight"
    _edit(d, key, lambda t: t.__setitem__(key, t[key].float().to(torch.float8_e5m2)))
    _refused(d, f"{key} is F8_E5M2")


def test_refuses_a_scale_on_a_module_not_to_convert(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    key = "model.layers.3.self_attn.q_proj.weight_scale_inv"
    scale = torch.ones(1, 1, dtype=torch.bfloat16)
    _edit(d, "model.layers.3.self_attn.q_proj.weight", lambda t: t.__setitem__(key, scale))
    _refused(d, f"unexpected: {key}", "modules_to_not_convert")


def test_refuses_fp8_experts_without_a_declared_scheme(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    _refused(d, f"{EXPERT}.gate_proj.weight is F8_E4M3 but config.json declares no quantization_config")


def test_quantize_command_refuses_another_checkpoint_unless_overwrite(checkpoints, tmp_path, capsys):
    src = checkpoints[0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    assert cli_main(["quantize", "--weights", "fp8", str(src), str(out)]) != 0
    assert "not empty" in capsys.readouterr().err and (out / "model-00009-of-00009.safetensors").exists()
    assert cli_main(["quantize", "--weights", "fp8", str(src), str(out), "--overwrite"]) == 0
    assert "block FP8" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in checkpoints[1].iterdir())
    assert _tensors(out).keys() == _tensors(checkpoints[1]).keys()
    assert cli_main(["quantize", str(src), str(tmp_path / "neither")]) != 0
    assert "--weights fp8 or --ngram fp8" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="already quantised"):
        quantize_weights(checkpoints[1], tmp_path / "twice")


def test_quantize_weights_refuses_out_equal_to_or_holding_in(checkpoints, tmp_path):
    """`quantize --weights` shares `quantize --ngram`'s target check: OUT may be neither IN nor a folder holding it
    (with --overwrite that would delete IN); IN is left untouched."""
    src = tmp_path / "in"
    shutil.copytree(checkpoints[0], src)
    files = sorted(p.name for p in src.iterdir())
    with pytest.raises(CheckpointError, match="OUT must differ from IN"):
        quantize_weights(src, src)
    with pytest.raises(CheckpointError, match="must differ from IN.*not contain it"):
        quantize_weights(src, tmp_path, overwrite=True)
    assert sorted(p.name for p in src.iterdir()) == files


def test_refuses_a_layer_mixing_fp8_and_bf16_experts(checkpoints, tmp_path):
    d = _copy(checkpoints, tmp_path)
    key = f"{EXPERT}.down_proj.weight"

    def to_bf16(t):
        t[key] = t[key].bfloat16()  # its values without the scale: a silent cast into FP8 would corrupt them
        t.pop(key.removesuffix(".weight") + ".weight_scale_inv")

    _edit(d, key, to_bf16)
    _refused(d, f"wrong dtype: {key} is [256, 128] BF16, expected F8_E4M3")
