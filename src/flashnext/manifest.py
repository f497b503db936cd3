"""The parameter manifest: every tensor the builder creates for a config, by state-dict name and shape, without
building anything (`parameters`). Held equal to a built model's `named_parameters` by `tests/test_plan.py`; the
memory plan (`flashnext.plan`) prices it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashnext.config import LINEAR, ModelConfig, TextConfig, VisionConfig

# parameter kinds
PLAIN, MATRIX, EXPERTS, TABLE = "plain", "matrix", "experts", "table"


@dataclass(frozen=True)
class Param:
    """One parameter the builder creates: its state-dict name, shape, part of the plan and kind.

    kind: `matrix` (a 2-D linear weight a weight-only scheme applies to), `experts` (stacked `[E, N, K]`;
    `splits` matrices along N per expert in the official per-expert layout), `table` (an n-gram table) or `plain`.
    """

    name: str
    shape: tuple[int, ...]
    part: str
    kind: str = PLAIN
    splits: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def gdn_dims(cfg: TextConfig) -> tuple[int, int, int, int]:
    """GDN key heads, value heads, key head dim, value head dim."""
    return cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim


def _layer_params(cfg: TextConfig, pre: str, layer_type: str, ple_index: int | None, part: str) -> list[Param]:
    """The parameters of one decoder layer (`model/layer.py`) under prefix `pre`."""
    D, hc = cfg.hidden_size, cfg.hc_count
    out: list[Param] = []

    def add(name, shape, kind=PLAIN, p=part, splits=1):
        out.append(Param(pre + name, tuple(shape), p, kind, splits))

    if layer_type == LINEAR:
        a = "linear_attn."
        Hk, Hv, Dk, Dv = gdn_dims(cfg)
        conv_dim = 2 * Hk * Dk + Hv * Dv
        add(a + "dt_bias", (Hv,))
        add(a + "A_log", (Hv,))
        add(a + "conv1d.weight", (conv_dim, 1, cfg.linear_conv_kernel_dim))
        add(a + "norm.weight", (Dv,))
        add(a + "out_proj.weight", (D, Hv * Dv), MATRIX)
        add(a + "in_proj_qkv.weight", (conv_dim, D), MATRIX)
        add(a + "in_proj_z.weight", (Hv * Dv, D), MATRIX)
        add(a + "in_proj_b.weight", (Hv, D), MATRIX)
        add(a + "in_proj_a.weight", (Hv, D), MATRIX)
    else:
        a = "self_attn."
        H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for proj, (n, k) in {"q": (2 * H * Dh, D), "k": (Hkv * Dh, D), "v": (Hkv * Dh, D), "o": (D, H * Dh)}.items():
            add(f"{a}{proj}_proj.weight", (n, k), MATRIX)
            if cfg.attention_bias:
                add(f"{a}{proj}_proj.bias", (n,))
        add(a + "q_norm.weight", (Dh,))
        add(a + "k_norm.weight", (Dh,))
        Hi, Di = cfg.indexer_n_heads, cfg.indexer_head_dim
        add(a + "indexer.index_qk_proj.weight", ((Hi + 1) * Di, D), MATRIX)
        add(a + "indexer.q_layernorm.weight", (Di,))
        add(a + "indexer.k_layernorm.weight", (Di,))
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    experts_part = "routed experts" if part == "trunk" else part
    add("mlp.gate.weight", (E, D), MATRIX)
    add("mlp.experts.gate_up_proj", (E, 2 * I, D), EXPERTS, experts_part, splits=2)
    add("mlp.experts.down_proj", (E, D, I), EXPERTS, experts_part)
    add("mlp.shared_expert.gate_proj.weight", (Is, D), MATRIX)
    add("mlp.shared_expert.up_proj.weight", (Is, D), MATRIX)
    add("mlp.shared_expert.down_proj.weight", (D, Is), MATRIX)
    add("mlp.shared_expert_gate.weight", (1, D), MATRIX)
    if ple_index is not None:
        from flashnext.ngram_hash import hash_constants

        Ep, heads = cfg.ple_embed_dim, cfg.ngram_heads
        div = cfg.make_ngram_vocab_size_divisible_by
        rows = math.ceil(sum(hash_constants(cfg, ple_index)[1]) / div) * div
        add("ple.ple_embedding.ngram_embedding.weight", (rows, Ep // heads), TABLE, "n-gram tables")
        add("ple.key_proj.weight", (hc * D, Ep), MATRIX)
        add("ple.value_proj.weight", (D, Ep), MATRIX)
        for norm in ("norm_key", "norm_query", "norm_conv"):
            add(f"ple.{norm}.weight", (hc * D,))
        add("ple.conv1d.weight", (hc * D, 1, cfg.ple_conv_kernel_size))
    for hyper in ("attn_hyper_connection.", "mlp_hyper_connection."):
        out.extend(_hyper_params(cfg, pre + hyper, part, inject=True))
    return out


def _hyper_params(cfg: TextConfig, pre: str, part: str, inject: bool) -> list[Param]:
    width, r = cfg.hc_count * cfg.hidden_size, cfg.hc_lowrank
    out = [
        Param(pre + "hc_norm.weight", (width,), part),
        Param(pre + "input_mix_weight_down.weight", (r, width), part, MATRIX),
        Param(pre + "input_mix_weight_up.weight", (width, r), part, MATRIX),
    ]
    if inject:
        out.append(Param(pre + "block_inject_weight.weight", (cfg.hc_count, width), part, MATRIX))
    return out


def _vision_params(v: VisionConfig, out_width: int) -> list[Param]:
    pre, C, part = "model.visual.", v.hidden_size, "vision tower"
    merged = C * v.spatial_merge_size**2
    shapes = {
        "patch_embed.proj.weight": (C, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "patch_embed.proj.bias": (C,),
        "pos_embed.weight": (v.num_position_embeddings, C),
    }
    for b in range(v.depth):
        blk = f"blocks.{b}."
        for norm in ("norm1", "norm2"):
            shapes[f"{blk}{norm}.weight"] = shapes[f"{blk}{norm}.bias"] = (C,)
        shapes[f"{blk}attn.qkv.weight"], shapes[f"{blk}attn.qkv.bias"] = (3 * C, C), (3 * C,)
        shapes[f"{blk}attn.proj.weight"], shapes[f"{blk}attn.proj.bias"] = (C, C), (C,)
        shapes[f"{blk}mlp.linear_fc1.weight"] = (v.intermediate_size, C)
        shapes[f"{blk}mlp.linear_fc1.bias"] = (v.intermediate_size,)
        shapes[f"{blk}mlp.linear_fc2.weight"], shapes[f"{blk}mlp.linear_fc2.bias"] = (C, v.intermediate_size), (C,)
    shapes["merger.norm.weight"] = shapes["merger.norm.bias"] = (C,)
    shapes["merger.linear_fc1.weight"], shapes["merger.linear_fc1.bias"] = (merged, merged), (merged,)
    shapes["merger.linear_fc2.weight"], shapes["merger.linear_fc2.bias"] = (out_width, merged), (out_width,)
    return [Param(pre + name, shape, part) for name, shape in shapes.items()]


def parameters(cfg: ModelConfig, with_mtp: bool = True) -> list[Param]:
    """Every parameter the builder creates for `cfg`, by state-dict name (the composite model's decoder under
    `model.language_model.`); the MTP head's when the config declares one and `with_mtp`."""
    text = cfg.text
    pre = "model.language_model." if cfg.composite else "model."
    out = [Param(pre + "embed_tokens.weight", (text.vocab_size, text.hidden_size), "embeddings")]
    for i, layer_type in enumerate(text.layer_types):
        ple = text.ple_layer_ids.index(i + 1) if i + 1 in text.ple_layer_ids else None
        out += _layer_params(text, f"{pre}layers.{i}.", layer_type, ple, "trunk")
    out += _hyper_params(text, pre + "hyper_connection_mixer.", "trunk", inject=False)
    out.append(Param("lm_head.weight", (text.vocab_size, text.hidden_size), "lm_head", MATRIX))
    if text.mtp_layers and with_mtp:
        D, hc = text.hidden_size, text.hc_count
        out += [
            Param("mtp.pre_fc_norm_embedding.weight", (D,), "MTP head"),
            Param("mtp.pre_fc_norm_hidden.weight", (hc * D,), "MTP head"),
            Param("mtp.fc_embedding.weight", (D, D), "MTP head", MATRIX),
            Param("mtp.fc_hidden.weight", (D, D), "MTP head", MATRIX),
        ]
        for i in range(text.mtp_layers):
            out += _layer_params(text, f"mtp.layers.{i}.", "indexed_attention", None, "MTP head")
        out += _hyper_params(text, "mtp.hyper_connection_mixer.", "MTP head", inject=False)
    vision = cfg.vision_config
    if vision is not None:
        out += _vision_params(vision, text.hidden_size)
    return out
