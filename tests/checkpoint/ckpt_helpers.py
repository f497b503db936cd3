"""Helpers for checkpoint tests: tiny reference models with every float weight randomised, file rewriting.

Imported by module name (`from ckpt_helpers import ...`): pytest puts this test folder on `sys.path`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TINY_TEXT = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
    hc_count=2, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
    ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    eos_token_id=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip

TINY_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
)  # fmt: skip


def tiny_text(**overrides) -> dict:
    """Kwargs for a tiny `Qwen4ExpTextConfig`, with overrides."""
    return {**json.loads(json.dumps(TINY_TEXT)), **overrides}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Distinct random values in every float parameter, so any swapped or misplaced slice shows."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=gen))
    return model


def build_text_reference(seed: int = 0, **overrides):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    torch.manual_seed(seed)
    return randomize(Qwen4ExpForCausalLM(Qwen4ExpTextConfig(**tiny_text(**overrides))), seed).eval()


def build_composite_reference(seed: int = 0, **text_overrides):
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen4ExpConfig(text_config=tiny_text(**text_overrides), vision_config=dict(TINY_VISION))
    return randomize(Qwen4ExpForConditionalGeneration(cfg), seed).eval()


def headers(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, dtype) over every safetensors file in `directory`."""
    out = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                out[k] = (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
    return out


def rewrite(file: Path, edit) -> None:
    """Replace a safetensors file by `edit(dict_of_tensors)` (the dict is edited in place)."""
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(ref), (sorted(set(ours) - set(ref)), sorted(set(ref) - set(ours)))
    bad = [k for k in ref if ours[k].dtype != ref[k].dtype or not torch.equal(ours[k], ref[k])]
    assert not bad, bad
