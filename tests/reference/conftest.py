"""Harness for oracle tests: tiny transformers `qwen4_exp` references with every weight randomised.

The reference zero-initialises its `(1 + w)` RMSNorm weights and the PLE conv, and sets the gated norm to
ones: a comparison against such a model cannot tell `(1 + w)` from `w`, or a skipped PLE conv from a
correct one.
`build_reference` therefore refills every float parameter with values of the right scale per kind, so each
one changes the output. Integer buffers (the n-gram hash multipliers, head sizes and offsets) stay as built.

Use from a test (fixtures return the plain functions, so no import of this file is needed):

    def test_x(tiny_text_config, reference_factory):
        ref, ckpt_dir = reference_factory(tiny_text_config(hc_count=4), seed=1)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

# Tiny but complete: 3 GDN layers (one with PLE) + 1 QSA layer; 8 indexer heads keep QSA ties rare (1/256 per
# block) so parity with the reference's arbitrary tie order holds.
_TINY = dict(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    hc_count=2,
    hc_lowrank=8,
    ple_layer_ids=[2],
    ple_embed_dim=16,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=4,
    indexer_n_heads=8,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
    eos_token_id=3,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


def tiny_text_config(**overrides) -> dict:
    """Kwargs for `Qwen4ExpTextConfig` of a tiny model, with `overrides` applied.

    `partial_rotary_factor=` and `rope_theta=` are accepted as shortcuts into `rope_parameters`.
    `ple_layer_ids=[]` turns PLE off; `indexer_n_heads=None` (with the other indexer fields) turns QSA off.
    """
    cfg = {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v) for k, v in _TINY.items()}
    rope = cfg["rope_parameters"]
    for key in ("partial_rotary_factor", "rope_theta"):
        if key in overrides:
            rope[key] = overrides.pop(key)
    cfg.update(overrides)
    return cfg


def _fan_in_std(p: torch.Tensor) -> float:
    # Linear / stacked-expert weights are [..., out, in]: unit-scale activations at every depth.
    return 1.0 / math.sqrt(p.shape[-1])


@torch.no_grad()
def randomize_reference(model: torch.nn.Module, seed: int) -> None:
    """Refill every float parameter of a reference model in place, deterministically from `seed`."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref_mod

    gen = torch.Generator().manual_seed(seed)

    def normal(p: torch.Tensor, mean: float, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(std).add_(mean).to(p.dtype))

    owners = {}
    for mod_name, mod in model.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = mod

    for name, p in model.named_parameters():
        if not p.is_floating_point():
            continue
        mod = owners[name]
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, ref_mod.Qwen4ExpTextRMSNorm):
            normal(p, 0.0, 0.2)  # scales by (1 + w): zero would hide a missing "1 +"
        elif isinstance(mod, ref_mod.Qwen4ExpTextRMSNormGated):
            normal(p, 1.0, 0.2)  # scales by w
        elif leaf == "A_log":
            u = torch.rand(p.shape, generator=gen) * (4.0 - 0.25) + 0.25  # decay rate in [0.25, 4]
            p.copy_(u.log())
        elif leaf == "dt_bias":
            normal(p, 0.5, 0.5)
        elif isinstance(mod, torch.nn.Conv1d):
            normal(p, 0.0, 0.3)  # GDN and (zero-initialised) PLE depthwise convs, [C, 1, K]
        elif isinstance(mod, torch.nn.Embedding):
            normal(p, 0.0, 0.5)  # token and n-gram tables
        elif p.dim() >= 2:
            normal(p, 0.0, _fan_in_std(p))
        else:
            normal(p, 0.0, 0.2)


def build_reference(cfg_kwargs: dict, seed: int = 0) -> Qwen4ExpForCausalLM:
    """The transformers reference in fp32 eval mode, eager attention, float weights randomised from `seed`."""
    config = Qwen4ExpTextConfig(**cfg_kwargs)
    torch.manual_seed(seed)  # the reference draws A_log at construction
    model = Qwen4ExpForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_reference(model, seed)
    return model.eval()


def save_reference(model: Qwen4ExpForCausalLM, directory: Path) -> Path:
    """Write the reference's official checkpoint layout (config.json + safetensors) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, the issue's parity metric."""
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.fixture(name="tiny_text_config")
def _tiny_text_config_fixture():
    return tiny_text_config


@pytest.fixture(name="build_reference")
def _build_reference_fixture():
    return build_reference


@pytest.fixture(name="rel_error")
def _rel_error_fixture():
    return rel_error


@pytest.fixture
def reference_factory(tmp_path):
    """`make(cfg_kwargs=None, seed=0) -> (ref_model, ckpt_dir)`, each saved in a new subdir of tmp_path."""
    count = 0

    def make(cfg_kwargs: dict | None = None, seed: int = 0):
        nonlocal count
        count += 1
        ref = build_reference(cfg_kwargs if cfg_kwargs is not None else tiny_text_config(), seed)
        return ref, save_reference(ref, tmp_path / f"ref{count}")

    return make


@pytest.fixture
def reference_checkpoint(reference_factory):
    """`(ref_model, ckpt_dir)` for the default tiny config, seed 0."""
    return reference_factory()
