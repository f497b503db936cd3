"""`benchmarks/gguf_convert.py` (the GGUF file `benchmarks/vs_llamacpp.py` gives llama.cpp), without llama.cpp.

What this holds: the file round-trips through the format (header, typed metadata, tensor table, alignment, bytes),
every floating-point parameter of the model lands in the file exactly once (splits keep the element count), and the
value transforms are the documented ones. Whether llama.cpp computes our function from it is checked by
`vs_llamacpp.py` against a llama.cpp build (greedy tokens compared before any timing).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from flashnext.config import parse_config
from flashnext.model.text import FlashNextForCausalLM

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gg():
    spec = importlib.util.spec_from_file_location("gguf_convert", ROOT / "benchmarks" / "gguf_convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(small_config: dict, **overrides) -> FlashNextForCausalLM:
    cfg = {**small_config, "ple_embed_dim": small_config["hidden_size"], "output_gate_type": "sigmoid", **overrides}
    model = FlashNextForCausalLM(parse_config(cfg).text)
    model.init_weights(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_roundtrip_places_every_parameter_once(gg, small_config, tmp_path, dtype):
    model = _model(small_config)
    meta, tensors = gg.convert(model, dtype)
    gg.write_gguf(tmp_path / "m.gguf", meta, tensors)
    meta2, read = gg.read_gguf(tmp_path / "m.gguf")
    assert meta2["general.architecture"] == "qwen4exp" and meta2["qwen4exp.block_count"] == 4
    assert meta2["qwen4exp.ple.layers"] == [1] and meta2["tokenizer.ggml.tokens"][:2] == ["<t0>", "<t1>"]
    assert meta2["qwen4exp.attention.compress_ratios"] == [0, 0, 0, 4]
    assert len(read) == len(tensors)  # names unique
    for name, t in tensors:
        dims, kind, data = read[name]
        assert dims == list(reversed(t.shape)) and kind == (0 if t.dtype == torch.float32 else 30), name
        assert data == t.view(torch.uint8).numpy().tobytes(), name
    kinds = {name: t.dtype for name, t in tensors}
    # matrices in the requested dtype; norms, the decay parameters and the convs in F32 (as llama.cpp keeps them)
    assert kinds["output.weight"] == kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.3.attn_q.weight"] == dtype
    assert {kinds["blk.0.hc_attn_norm.weight"], kinds["blk.0.ssm_a"], kinds["blk.0.ssm_conv1d.weight"]} == {
        torch.float32
    }
    floats = sum(p.numel() for p in model.state_dict().values() if p.is_floating_point())
    assert sum(t.numel() for _, t in tensors) == floats


def test_value_transforms(gg, small_config):
    model = _model(small_config)
    _, tensors = gg.convert(model, torch.float32)
    out = dict(tensors)
    gdn = model.model.layers[0].linear_attn
    # 1 key head, 2 value heads: the value heads' order is unchanged (per_k = 2, K = 1: tiled == grouped)
    torch.testing.assert_close(out["blk.0.ssm_a"], -gdn.A_log.detach().float().exp())
    torch.testing.assert_close(out["blk.0.ssm_dt.bias"], gdn.dt_bias.detach())
    torch.testing.assert_close(out["blk.0.ssm_conv1d.weight"], gdn.conv1d.weight.detach().squeeze(1))
    torch.testing.assert_close(
        out["blk.0.hc_attn_norm.weight"], model.model.layers[0].attn_hyper_connection.hc_norm.weight.detach() + 1
    )
    torch.testing.assert_close(out["blk.0.ssm_norm.weight"], gdn.norm.weight.detach())  # scales by w: as is
    qk = model.model.layers[3].self_attn.indexer.index_qk_proj.weight.detach()
    torch.testing.assert_close(torch.cat([out["blk.3.indexer.q_proj.weight"], out["blk.3.indexer.k_proj.weight"]]), qk)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    torch.testing.assert_close(
        torch.cat([out["blk.0.ffn_gate_exps.weight"], out["blk.0.ffn_up_exps.weight"]], 1), gate_up
    )


def test_value_heads_tile(gg):
    """Grouped [K0: v0 v1 v2, K1: v0 v1 v2] -> tiled [v0: K0 K1, v1: K0 K1, v2: K0 K1] (llama.cpp's repeat order)."""
    grouped = torch.arange(2 * 3 * 2).reshape(12, 1)  # K=2 key heads, 3 values per key head, head dim 2
    tiled = gg._tiled(grouped, 0, 2, 3, 2).flatten().tolist()
    assert tiled == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]


def test_unsupported_config_is_named(gg, small_config):
    model = FlashNextForCausalLM(parse_config({**small_config, "ple_layer_ids": [1, 2]}).text)
    with pytest.raises(ValueError, match="2 PLE layers.*output gate 'silu'.*ple_embed_dim 8 != hidden_size"):
        gg.convert(model, torch.float32)
