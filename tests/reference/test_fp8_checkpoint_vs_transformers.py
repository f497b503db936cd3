"""The oracle for the FP8 checkpoint: what `flashnext quantize --weights fp8` writes, transformers loads (it
dequantises on CPU), and its logits agree with ours from the same files.

Bounds: in fp32 both sides dequantise the same FP8 bytes with the same fp32 products (asserted bitwise), so the
logits differ only by fp32 kernel rounding: the parity bound, 1e-4 relative. In bf16 each side rounds its own way,
so our bf16 logits must be as close to the fp32 function as the reference's bf16 ones are (<= 1.5x, as
`test_bf16.py`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import flashnext
from flashnext.checkpoint.quantize_weights import quantize_weights
from flashnext.model.quant_experts_fp8 import Fp8Experts

pytest.importorskip("accelerate")  # transformers needs it for any quantized checkpoint
from transformers import Qwen4ExpForCausalLM  # noqa: E402


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    # The harness (this folder's conftest.py) by path: a module-scoped fixture cannot take its function-scoped ones.
    spec = importlib.util.spec_from_file_location("_fp8_harness", Path(__file__).with_name("conftest.py"))
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    build_reference, tiny_text_config = harness.build_reference, harness.tiny_text_config
    root = tmp_path_factory.mktemp("fp8_oracle")
    cfg = tiny_text_config(hidden_size=256, moe_intermediate_size=128, num_experts=8)  # grids [1, 2] and [2, 1]
    build_reference(cfg, seed=0).to(torch.bfloat16).save_pretrained(root / "bf16")
    quantize_weights(root / "bf16", root / "fp8")
    return root / "fp8"


IDS = torch.randint(4, 128, (2, 33), generator=torch.Generator().manual_seed(0))


def _fp32_reference(path):
    # Asked for fp32, transformers dequantises the experts to fp32 and keeps the checkpoint's BF16 tensors (and its
    # BF16 table scale) as stored; `.float()` makes the rest fp32 exactly (BF16 and FP8 values are fp32 values).
    ref = Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return ref.float().eval()


def test_transformers_loads_our_fp8_checkpoint_and_agrees_in_fp32(fp8_checkpoint, rel_error):
    ours, ref = flashnext.from_pretrained(fp8_checkpoint), _fp32_reference(fp8_checkpoint)
    for ours_layer, ref_layer in zip(ours.model.layers, ref.model.layers, strict=True):
        assert isinstance(ours_layer.mlp.experts, Fp8Experts)
        gate_up, down = ours_layer.mlp.experts.dequantize(torch.arange(8))
        assert torch.equal(gate_up, ref_layer.mlp.experts.gate_up_proj)
        assert torch.equal(down, ref_layer.mlp.experts.down_proj)
    with torch.no_grad():
        assert rel_error(ours(IDS).logits, ref(input_ids=IDS).logits) <= 1e-4


@pytest.mark.slow
def test_fp8_checkpoint_in_bf16_tracks_the_reference_bf16(fp8_checkpoint, rel_error):
    ref16 = Qwen4ExpForCausalLM.from_pretrained(fp8_checkpoint, dtype=torch.bfloat16, attn_implementation="eager")
    ours16 = flashnext.from_pretrained(fp8_checkpoint, dtype=torch.bfloat16)
    with torch.no_grad():
        exact = _fp32_reference(fp8_checkpoint)(input_ids=IDS).logits
        err_ref = rel_error(ref16.eval()(input_ids=IDS).logits.float(), exact)
        err_ours = rel_error(ours16(IDS).logits.float(), exact)
    assert err_ours <= 1.5 * err_ref, (err_ours, err_ref)
