"""FLOPs of one packed forward: an analytic count per component, and torch's `FlopCounterMode` on `meta`.

Conventions: forward only, a multiply-add is 2 FLOPs, `[m, k] @ [k, n]` costs `2 m k n`. Lookups (token and
n-gram embeddings), norms, activations, RoPE and softmax are not counted (elementwise, as `FlopCounterMode`).
One non-matmul term is counted analytically because it grows like a matmul: the depthwise convs (`2 T C K`, term
`conv`); `FlopCounterMode` does not see it (the convs run as shifted multiply-adds), so `NOT_MATMUL` names it for
comparisons.

Components (T tokens, D hidden, hc streams, V vocab; per layer kind):
- `gdn`: projections `2 T D (2 Hk Dk + 2 Hv Dv + 2 Hv)` + `out_proj`, the conv, and the chunked delta rule as
  `ops.deltanet` runs it: every sequence cut into `C = 64`-token chunks (the last one padded), per chunk and
  value head `4 C^2 Dk` (`k_beta k^T`, `q k^T`) + `2 C^2 (Dk + Dv)` (the chunk's `A`, `B`) + `2 C Dk (Dk + Dv)`
  (`M`, `U`) + `2 Dk^2 Dv` (the scan step) + `2 C Dk Dv` (output), and the solve: the unit-triangular inverse
  (`ops.deltanet.solve_unit_lower`'s block products) applied to `Dk + Dv` columns. Its cost is linear in T like
  the recurrence's `~6 T Hv Dk Dv`, with a `C`-sized constant.
- `qsa_indexer`: `index_qk_proj` and the scores of each query against the complete blocks it can see
  (`2 Hi Di` per block).
- `qsa_attention`: q (with gate) / k / v / o projections, and QK^T + PV over the selected tokens only:
  `min(complete_blocks, budget / c) * c + tail` per query, `4 H Dh` per selected token.
- `moe_routed`: `T k` expert SwiGLUs, `6 D I` each; `router`: `2 T D E`; `moe_shared`: `6 T D I_s` + its gate.
- `ple`: key/value projections of the n-gram embedding and the dilated conv; `hyper`: the stream mixers
  (down, up, inject) of every layer and the final mixer; `lm_head`: `2 T D V`.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from flashnext.config import LINEAR, TextConfig
from flashnext.ops.deltanet import CHUNK

COMPONENTS = (
    "gdn",
    "qsa_indexer",
    "qsa_attention",
    "moe_routed",
    "moe_shared",
    "router",
    "ple",
    "hyper",
    "lm_head",
)
NOT_MATMUL = ("conv",)


def flop_terms(cfg: TextConfig, seq_lens: list[int]) -> dict[str, dict[str, float]]:
    """Analytic forward FLOPs of one packed batch, per component and term (`count_flops` sums the terms)."""
    T, D = sum(seq_lens), cfg.hidden_size
    n_linear = sum(t == LINEAR for t in cfg.layer_types)
    n_attn = cfg.num_hidden_layers - n_linear
    terms: dict[str, dict[str, float]] = {c: {} for c in COMPONENTS}
    if n_linear:
        terms["gdn"] = {k: n_linear * v for k, v in _gdn_layer(cfg, seq_lens).items()}
    if n_attn:
        indexer, attention = _qsa_layer(cfg, seq_lens)
        terms["qsa_indexer"] = {k: n_attn * v for k, v in indexer.items()}
        terms["qsa_attention"] = {k: n_attn * v for k, v in attention.items()}
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    terms["moe_routed"] = {"experts": L * T * k * 6 * D * cfg.moe_intermediate_size}
    terms["router"] = {"gate": L * 2 * T * D * E}
    terms["moe_shared"] = {"mlp": L * 6 * T * D * cfg.shared_expert_intermediate_size, "gate": L * 2 * T * D}
    if cfg.ple_layer_ids:
        P, hcD = len(cfg.ple_layer_ids), cfg.hc_count * D
        terms["ple"] = {
            "proj": P * 2 * T * cfg.ple_embed_dim * (hcD + D),
            "conv": P * 2 * T * hcD * cfg.ple_conv_kernel_size,
        }
    hcD, r = cfg.hc_count * D, cfg.hc_lowrank
    mix = 2 * T * hcD * r * 2  # down + up
    terms["hyper"] = {"mix": (2 * L + 1) * mix, "inject": 2 * L * 2 * T * hcD * cfg.hc_count}
    terms["lm_head"] = {"proj": 2 * T * D * cfg.vocab_size}
    return {c: {name: float(v) for name, v in t.items()} for c, t in terms.items()}


def count_flops(cfg: TextConfig, seq_lens: list[int]) -> dict[str, float]:
    """Analytic forward FLOPs of one packed batch of sequences `seq_lens`, per component and `total`.

    See the module docstring for the formulas. Example: `count_flops(cfg, [4096, 512, 1])["total"]`.
    """
    out = {c: sum(t.values()) for c, t in flop_terms(cfg, seq_lens).items()}
    out["total"] = sum(out.values())
    return out


def _gdn_layer(cfg: TextConfig, seq_lens: list[int]) -> dict[str, int]:
    T, D = sum(seq_lens), cfg.hidden_size
    Hk, Hv, Dk, Dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    conv_dim = 2 * Hk * Dk + Hv * Dv
    C = CHUNK
    chunks = sum(-(-n // C) for n in seq_lens) * Hv
    intra = 4 * C * C * Dk + 2 * C * C * (Dk + Dv) + 2 * C * Dk * (Dk + Dv)
    return {
        "proj": 2 * T * D * (conv_dim + Hv * Dv + 2 * Hv) + 2 * T * Hv * Dv * D,
        "conv": 2 * T * conv_dim * cfg.linear_conv_kernel_dim,
        "chunk": chunks * (intra + 2 * Dk * Dk * Dv + 2 * C * Dk * Dv),
        "solve": chunks * (_unit_lower_inverse_flops(C) + 2 * C * C * (Dk + Dv)),
    }


def _unit_lower_inverse_flops(C: int) -> int:
    """Matmul FLOPs of `ops.deltanet`'s C x C unit-triangular inverse: row steps in 16-blocks, then merges."""
    P = 1 << max(0, (C - 1).bit_length())
    b = min(16, P)
    flops = (P // b) * sum(2 * i * i for i in range(1, b))
    while b < P:
        flops += (P // (2 * b)) * 2 * (2 * b**3)
        b *= 2
    return flops


def _qsa_layer(cfg: TextConfig, seq_lens: list[int]) -> tuple[dict[str, int], dict[str, int]]:
    T, D = sum(seq_lens), cfg.hidden_size
    Hi, Di, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    kb = cfg.indexer_budget // c
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    blocks_seen = selected = 0
    for n in seq_lens:
        for p in range(n):
            complete, tail = divmod(p + 1, c)
            blocks_seen += complete
            selected += min(complete, kb) * c + tail
    indexer = {"proj": 2 * T * D * (Hi + 1) * Di, "scores": 2 * Hi * Di * blocks_seen}
    attention = {
        "proj": 2 * T * D * (2 * H * Dh + 2 * Hkv * Dh) + 2 * T * H * Dh * D,
        "attend": 4 * H * Dh * selected,
    }
    return indexer, attention


def _component(module_path: str) -> str | None:
    """Component of a module path relative to the model (`model.layers.3.self_attn.indexer`), or None."""
    parts = module_path.split(".")
    if parts == ["lm_head"]:
        return "lm_head"
    if parts == ["model", "hyper_connection_mixer"]:
        return "hyper"
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    rest = parts[3:]
    table = {
        ("linear_attn",): "gdn",
        ("self_attn", "indexer"): "qsa_indexer",
        ("ple",): "ple",
        ("attn_hyper_connection",): "hyper",
        ("mlp_hyper_connection",): "hyper",
        ("mlp", "experts"): "moe_routed",
        ("mlp", "gate"): "router",
        ("mlp", "shared_expert"): "moe_shared",
        ("mlp", "shared_expert_gate"): "moe_shared",
    }
    return table.get(tuple(rest))


def measure_flops_on_meta(cfg: TextConfig, seq_lens: list[int]) -> dict[str, float]:
    """Forward FLOPs that torch's `FlopCounterMode` counts for a packed batch on the `meta` device.

    Builds `FlashNextForCausalLM` under `torch.device("meta")` (no weights, no GPU needed) and runs flat meta
    ids with a CPU `cu_seqlens`. This counts the matmuls actually issued: on meta the MoE takes its
    per-assignment gather path (same FLOPs as the analytic count), QSA attention multiplies every query against
    its `(budget / c + 1) * c` gathered slots (masked ones included) and the indexer scores every block of its
    query chunk's range, so those two are upper bounds of the analytic (useful) counts; the convs are not
    counted (see `NOT_MATMUL`).

    Returns:
        the same keys as `count_flops`, plus `other` (counted FLOPs outside every component; 0 today).
    """
    from flashnext.model.text import FlashNextForCausalLM

    with torch.device("meta"):
        model = FlashNextForCausalLM(cfg)
    T = sum(seq_lens)
    cu = torch.tensor([0, *seq_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    pos = torch.cat([torch.arange(n) for n in seq_lens]).to("meta")
    ids = torch.empty(T, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(ids, cu_seqlens=cu, position_ids=pos)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    out = dict.fromkeys(COMPONENTS, 0.0)
    for name, flops in counts.items():
        if not name.startswith(root + "."):
            continue
        path = name[len(root) + 1 :]
        comp = _component(path)
        if comp is not None:
            out[comp] += flops
        elif path.endswith(".self_attn"):  # attention minus its indexer (a submodule counted on its own)
            out["qsa_attention"] += flops - counts.get(name + ".indexer", 0)
    out["total"] = float(counts.get("Global", 0))
    out["other"] = out["total"] - sum(out[c] for c in COMPONENTS)
    return out
