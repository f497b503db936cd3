"""The memory plan (`flashnext.plan`, `flashnext plan`): its parameter manifest equals what the builder creates, its
bytes equal the real allocations (parameters, fused serving copies, `StateCache`), the released model's config gives
the published checkpoint sizes, and `serve` / `train` refuse a model that cannot fit before loading anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashnext import save_pretrained
from flashnext.build import build_model
from flashnext.cli import main
from flashnext.config import parse_config, tiny_config_dict
from flashnext.errors import ConfigError
from flashnext.manifest import parameters
from flashnext.model.fused import groups
from flashnext.plan import (
    PlanOptions,
    StoredAs,
    budget_capacity,
    fused_copy_bytes,
    make_plan,
    matrix_bytes,
    parse_bytes,
    shortfall,
    state_bytes,
    weight_rows,
)
from flashnext.serve.cache import StateCache
from flashnext.serve.prepare import prepare_for_inference

VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
    spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
)  # fmt: skip

# The released Qwen3.8-Flash-Next (../shared/reference/QUANT.md: 36 GDN + 12 QSA layers, hidden 2560, 512 experts
# top-10, moe_intermediate_size 640, GDN heads 16 K / 48 V of dim 128; the rest as the public fixture "shaped like
# the released checkpoints" lists it), with its vision tower and one MTP layer.
RELEASED_TEXT = dict(
    model_type="qwen4_exp_text", num_hidden_layers=48, hidden_size=2560, vocab_size=248320, head_dim=256,
    num_attention_heads=24, num_key_value_heads=2,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, output_gate_type="sigmoid", indexer_n_heads=4, indexer_kv_heads=1,
    indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, hc_count=4, hc_lowrank=320,
    ple_layer_ids=[2], ple_embed_dim=2560, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8,
    ngram_vocab_size_base=20000000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128,
    bos_token_id=248044, eos_token_id=248044, mtp_num_hidden_layers=1,
)  # fmt: skip
RELEASED_VISION = dict(
    hidden_size=1152, depth=27, num_heads=16, intermediate_size=4304, patch_size=16, temporal_patch_size=2,
    spatial_merge_size=2, num_position_embeddings=2304, out_hidden_size=2560, in_channels=3,
)  # fmt: skip
QWEN_FP8 = {
    "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens"],
    "modules_to_convert": ["ple.ple_embedding.ngram_embedding"],
}  # fmt: skip
RELEASED = dict(
    model_type="qwen4_exp", image_token_id=248056, text_config=RELEASED_TEXT, vision_config=RELEASED_VISION,
    dtype="bfloat16",
)  # fmt: skip


def _configs():
    return {
        "text": parse_config(tiny_config_dict()),
        "composite": parse_config(
            dict(model_type="qwen4_exp", text_config=tiny_config_dict(), vision_config=VISION, image_token_id=5)
        ),
        "gqa-bias-2ple": parse_config({**tiny_config_dict(), "attention_bias": True, "ple_layer_ids": [1, 3],
                                       "hc_count": 3, "num_key_value_heads": 1}),  # fmt: skip
    }


@pytest.mark.parametrize("which", ["text", "composite", "gqa-bias-2ple"])
def test_manifest_and_bf16_bytes_equal_the_built_model(which):
    cfg = _configs()[which]
    model = build_model(cfg, seed=0, dtype=torch.bfloat16)
    with_mtp = model.mtp is not None
    manifest = {p.name: p.shape for p in parameters(cfg, with_mtp)}
    assert manifest == {n: tuple(p.shape) for n, p in model.named_parameters()}
    rows = weight_rows(cfg, PlanOptions(dtype="bf16", mtp=with_mtp), StoredAs())
    assert sum(r.bytes for r in rows) == sum(p.numel() * p.element_size() for p in model.parameters())
    by_part = {r.part: r.bytes for r in rows}
    assert by_part["routed experts"] == sum(
        p.nbytes for n, p in model.named_parameters() if ".mlp.experts." in n and not n.startswith("mtp.")
    )
    assert by_part["n-gram tables"] == sum(p.nbytes for n, p in model.named_parameters() if "ngram_embedding" in n)


@pytest.mark.parametrize("which", ["text", "composite", "gqa-bias-2ple"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_serving_rows_equal_the_engine_allocations(which, dtype):
    cfg = _configs()[which]
    model = build_model(cfg, seed=0, dtype=dtype)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    with_mtp = model.mtp is not None
    gdn, qsa = state_bytes(cfg.text, 3, 37, name, with_mtp)
    assert gdn + qsa == StateCache(model, max_slots=3, max_model_len=37).nbytes()
    prepare_for_inference(model)
    copies = [t for g in groups(model) for t in (*g._built[2:4], *(g._fp32 or ())) if t is not None]
    built = sum(t.nbytes for t in copies)  # fused weights and biases, and fp32 copies of small bf16 ones
    assert fused_copy_bytes(cfg, PlanOptions(dtype=name, mtp=with_mtp), name) == built


def test_scheme_bytes():
    # [N=2560, K=640]: fp8 blocks 20 x 5 bf16 scales; int8 a scale per row; int4 5 groups of (scale, zero) per row
    assert matrix_bytes(2560, 640, "bf16", 2) == 2560 * 640 * 2
    assert matrix_bytes(2560, 640, "fp8", 2) == 2560 * 640 + 20 * 5 * 2
    assert matrix_bytes(2560, 640, "int8", 2) == 2560 * 640 + 2560 * 2
    assert matrix_bytes(2560, 640, "int4", 2) == 2560 * 640 // 2 + 2560 * 5 * 2 * 2
    with pytest.raises(ConfigError, match="--trunk int4"):
        PlanOptions(trunk="int4").schemes(None)
    assert PlanOptions(weights="int4").schemes(None) == ("int8", "int4")
    assert PlanOptions(weights="fp8", dtype="bf16").schemes(None) == ("bf16", "fp8")
    assert PlanOptions(dtype="bf16").schemes("fp8") == ("bf16", "fp8")  # an FP8 checkpoint's experts stay FP8


def test_released_config_gives_the_published_checkpoint_sizes():
    """The released model's weights: 335.3 GiB in BF16 and 172.76 GiB as the official FP8 checkpoint (QUANT.md);
    the plan's weight rows land within 0.05% of both."""
    cfg = parse_config(RELEASED)
    bf16 = sum(r.bytes for r in weight_rows(cfg, PlanOptions(dtype="bf16", ngram_storage="dense"), StoredAs()))
    fp8 = weight_rows(cfg, PlanOptions(dtype="bf16"), StoredAs(table_dtype="fp8", experts="fp8"))
    assert bf16 / 2**30 == pytest.approx(335.3, rel=5e-4)
    assert sum(r.bytes for r in fp8) / 2**30 == pytest.approx(172.76, rel=5e-4)
    parts = {r.part: r.bytes / 2**30 for r in fp8}
    assert parts["n-gram tables"] == pytest.approx(47.68, abs=0.01)  # 128 F8_E4M3 shards of [2500012, 160]
    # the published 114.86 GiB of FP8 experts: the trunk's and the MTP head's, with their block scales
    mtp_experts = sum(p.numel for p in parameters(cfg) if p.name.startswith("mtp.") and ".experts." in p.name)
    assert parts["routed experts"] + mtp_experts / 2**30 == pytest.approx(114.86, abs=0.01)


@pytest.mark.parametrize(
    "flags, fits",
    [
        ([], {"141GB": False, "128GB": False, "64GB": False}),
        (["--weights", "fp8", "--ngram-storage", "mmap"], {"141GB": False, "128GB": False, "64GB": False}),
        (["--weights", "fp8", "--trunk", "int8", "--ngram-storage", "mmap"], {"141GB": True, "128GB": False}),
        (["--weights", "int4", "--ngram-storage", "nf4"], {"141GB": True, "128GB": True, "64GB": False}),
        (["--weights", "int4", "--ngram-storage", "mmap", "--max-slots", "1"], {"64GB": False}),
        (["--fp8-checkpoint", "--trunk", "int8", "--ngram-storage", "mmap"], {"141GB": True, "128GB": False}),
    ],
    ids=["as-stored", "fp8-mmap", "fp8-int8-mmap", "int4-nf4", "int4-mmap-1-slot", "fp8-checkpoint-mmap"],
)
def test_plan_command_on_the_released_config(tmp_path, capsys, flags, fits):
    fp8 = "--fp8-checkpoint" in flags  # the official FP8 checkpoint's config: its experts and table stay FP8
    flags = [f for f in flags if f != "--fp8-checkpoint"]
    config = {**RELEASED, "quantization_config": QWEN_FP8} if fp8 else RELEASED
    (tmp_path / "config.json").write_text(json.dumps(config))
    budgets = [a for b in fits for a in ("--budget", b)]
    assert main(["plan", str(tmp_path), *flags, *budgets]) in (0, None)
    out = capsys.readouterr().out
    for part in ("trunk", "routed experts", "lm_head", "embeddings", "n-gram tables", "MTP head", "vision tower",
                 "GDN/conv state", "QSA K/V + index keys", "workspace (estimate)", "total"):  # fmt: skip
        assert f"  {part} " in out, part
    for budget, ok in fits.items():
        assert (f"budget {budget}: fits" in out) == ok, out


def test_plan_reads_the_table_dtype_from_safetensors_headers(tmp_path):
    from flashnext.checkpoint.quantize import quantize_checkpoint
    from flashnext.plan import stored_as

    model = build_model(parse_config(tiny_config_dict()), seed=0, dtype=torch.bfloat16)
    save_pretrained(model, tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "fp8", ngram="fp8")
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert stored_as(tmp_path / "bf16", raw).table_dtype == "bf16"
    assert stored_as(tmp_path / "fp8", raw).table_dtype == "fp8" and stored_as(tmp_path / "fp8", raw).headers_read


def test_budget_parsing_and_shortfall():
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("128 GiB") == 128 * 2**30 and parse_bytes("64") == 64e9
    with pytest.raises(ConfigError, match="'lots'"):
        parse_bytes("lots")
    plan = make_plan(parse_config(tiny_config_dict()), PlanOptions(dtype="fp32"))
    assert shortfall(plan, budget_capacity(plan.total)) is None
    assert "needs" in shortfall(plan, budget_capacity(plan.total - 1))


def test_serve_refuses_before_loading_when_the_plan_cannot_fit(monkeypatch, capsys):
    import flashnext.serve.loading as loading
    from flashnext import plan as plan_mod

    monkeypatch.setattr(plan_mod, "machine_capacity", lambda device="cpu": plan_mod.budget_capacity(10**6))
    monkeypatch.setattr(loading, "load_for_serving", lambda *a, **k: pytest.fail("loaded despite the plan"))
    assert main(["generate", "--prompt", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert "QSA K/V + index keys" in err and "fits: NO" in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert "cannot fit" in line and "--ignore-memory-plan" in line


def test_train_refuses_before_building_when_the_plan_cannot_fit(monkeypatch, tmp_path, capsys):
    from flashnext import build
    from flashnext.plan import budget_capacity
    from flashnext.train import memory_plan

    monkeypatch.setattr(memory_plan, "machine_capacity", lambda device="cpu": budget_capacity(10**5))
    monkeypatch.setattr(build, "build_model", lambda *a, **k: pytest.fail("built despite the plan"))
    config = Path(__file__).parents[1] / "configs" / "tiny-sft.toml"
    args = ["train", "--config", str(config), f"--out_dir={json.dumps(str(tmp_path / 'run'))}", "--train.steps=6"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    assert "optimizer state" in out and "gradients" in out and "fits: NO" in out
    (line,) = err.strip().splitlines()
    assert "cannot fit" in line and "--train.ignore_memory_plan=true" in line
