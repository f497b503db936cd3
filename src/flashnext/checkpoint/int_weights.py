"""Weight-only int8 / int4 checkpoints on disk (`flashnext quantize --weights int8|int4`): the format, its checks,
and loading it straight into the quantized modules of `flashnext.quant` (no float copy of a quantized part).

`config.json` declares the scheme (top level; a text config's copy is accepted too), our own `quant_method`:
```
"quantization_config": {"quant_method": "flashnext_int", "format_version": 1,
                         "trunk": "int8", "experts": "int4", "group_size": 64,
                         "modules": {"int8": ["lm_head", "model.layers.0.linear_attn.in_proj_qkv", ...],
                                     "int4": ["model.layers.0.mlp.experts", ...]}}
```
`trunk` is "int8" or "bf16" (as stored), `experts` "int8", "int4" or "bf16"; `group_size` (32, 64 or 128) only with
int4 experts. `modules` lists, per scheme, every quantized module by its on-disk name: a linear (its `.weight` is
replaced), or a routed-experts module (the prefix of its per-expert `.{e}.{gate,up,down}_proj`). They are exactly
the modules `quant.apply.quantize_model` replaces for that scheme (`int_modules`); everything else (embeddings,
n-gram tables, norms, biases, convs, the vision tower, a tied `lm_head`) is stored as the source had it.

Tensors of a quantized module `M` (`M` a linear, or `{experts}.{e}.{gate,up,down}_proj`; a weight `[N, K]`):
- int8: `M.qweight` I8 `[N, K]` and `M.weight_scale` `[N]`: `w ~= qweight * weight_scale[:, None]`, symmetric per
  output row, codes in [-127, 127] (`quant.int_linear.quantize_int8`);
- int4: `M.qweight` U8 `[N, K/2]`, two codes per byte, code of input k = 2j in the LOW nibble of byte j, k = 2j+1 in
  the HIGH nibble; codes q in [0, 15]; `M.weight_scale` and `M.weight_zero` `[N, K/g]`:
  `w[n, k] ~= (q[n, k] - 8) * weight_scale[n, k // g] + weight_zero[n, k // g]` (`quant.int_experts.quantize_int4`);
- `M.bias`, when the linear has one, stays float.
Scales and zeros are BF16 (F16 for an F16 source): the dtype the CPU kernels take them in, rounded before the codes
are chosen, so dequantising them is exactly what the kernel multiplies by. This layout is portable (plain codes, row
major); the CPU kernel's packed int4 layout is made at load (`_convert_weight_to_int4pack_for_cpu`, per expert).

Loading it into the quantized modules, with no float copy of a quantized part: `quant/int_checkpoint.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashnext.checkpoint import layout
from flashnext.config import ModelConfig
from flashnext.errors import CheckpointError, ConfigError

QUANT_METHOD = "flashnext_int"
FORMAT_VERSION = 1
QUANT_KEY = "quantization_config"
TRUNK = ("bf16", "int8")
EXPERTS = ("bf16", "int8", "int4")
GROUPS = (32, 64, 128)
NO_GROUP = 64  # the group a scheme without int4 carries (`quant.apply.DEFAULT_GROUP`): unused, compared equal
SCALE_DTYPES = ("BF16", "F16")
PROJS = ("gate_proj", "up_proj", "down_proj")


# ---- the scheme ---------------------------------------------------------------------------------------------------
def int_quantization_config(trunk: str, experts: str, group: int, modules: dict[str, list[str]]) -> dict:
    """The `quantization_config` object of an int checkpoint (see the module doc)."""
    out = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION, "trunk": trunk, "experts": experts,
           "modules": {k: sorted(v) for k, v in modules.items() if v}}  # fmt: skip
    if experts == "int4":
        out["group_size"] = group
    return out


@dataclass
class IntScheme:
    """A parsed int `quantization_config`: part schemes, int4 group, {disk module name: "int8" / "int4"}."""

    trunk: str
    experts: str
    group: int
    modules: dict[str, str] = field(default_factory=dict)


def parse_int_config(raw) -> IntScheme | None:
    """The int scheme of a `quantization_config`, None when it is not ours (absent, or fp8).

    Raises:
        CheckpointError: naming the field: an unknown part scheme, group size or format version, a malformed
            module list.
    """
    if not isinstance(raw, dict) or raw.get("quant_method") != QUANT_METHOD:
        return None
    where = f"config.json {QUANT_KEY}"
    if raw.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}.format_version={raw.get('format_version')!r}: this flashnext reads "
                              f"{FORMAT_VERSION}")  # fmt: skip
    trunk, experts = raw.get("trunk"), raw.get("experts")
    if trunk not in TRUNK:
        raise CheckpointError(f"{where}.trunk={trunk!r}: expected one of {list(TRUNK)}")
    if experts not in EXPERTS:
        raise CheckpointError(f"{where}.experts={experts!r}: expected one of {list(EXPERTS)}")
    group = raw.get("group_size", 0) if experts == "int4" else NO_GROUP
    if experts == "int4" and group not in GROUPS:
        raise CheckpointError(f"{where}.group_size={group!r}: int4 groups of {list(GROUPS)} are implemented")
    mods = raw.get("modules")
    ok = isinstance(mods, dict) and all(k in ("int8", "int4") and isinstance(v, list) for k, v in mods.items())
    if not ok or not all(isinstance(m, str) for v in mods.values() for m in v):
        raise CheckpointError(f"{where}.modules must map 'int8' / 'int4' to lists of module names, got {mods!r}")
    return IntScheme(trunk, experts, group, {m: s for s, names in mods.items() for m in names})


def int_scheme(cfg: ModelConfig) -> IntScheme | None:
    """The checkpoint's int scheme from its config (top level, else the text config's), or None."""
    raw = cfg.top.get(QUANT_KEY) if cfg.composite else None
    return parse_int_config(raw if raw is not None else cfg.text.extra.get(QUANT_KEY))


def disk_module(our_name: str, kind: str, style: str) -> str:
    """Our module name -> its on-disk name (experts: the prefix of the per-expert modules)."""
    leaf = ".gate_up_proj" if kind == "experts" else ".weight"
    return layout.to_disk_name(our_name + leaf, style).removesuffix(leaf)


def code_shapes(scheme: str, n: int, k: int, group: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """{tensor suffix: (shape, allowed dtypes)} of one quantized `[n, k]` weight under `scheme`."""
    if scheme == "int8":
        return {".qweight": ((n, k), ("I8",)), ".weight_scale": ((n,), SCALE_DTYPES)}
    return {".qweight": ((n, k // 2), ("U8",)), ".weight_scale": ((n, k // group), SCALE_DTYPES),
            ".weight_zero": ((n, k // group), SCALE_DTYPES)}  # fmt: skip


def expert_matrices(pre: str, E: int, D: int, I: int) -> list[tuple[str, int, int]]:
    """(on-disk module, N, K) of every per-expert matrix of an experts module with disk prefix `pre`."""
    return [(f"{pre}.{e}.{p}", *((D, I) if p == "down_proj" else (I, D))) for e in range(E) for p in PROJS]


# ---- int4 nibble order -------------------------------------------------------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in [0, 15] -> uint8 [N, K/2]: code 2j in the low nibble of byte j, 2j+1 in the high one."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 codes [N, K] (`pack_nibbles`' inverse)."""
    return torch.stack([packed & 15, packed >> 4], -1).view(packed.shape[0], -1).to(torch.int32)


def check_scheme_matches(stored, asked) -> None:
    """Raise `ConfigError` when serving flags ask for another scheme than the checkpoint stores (`QuantScheme`s)."""
    same = (stored.trunk, stored.experts) == (asked.trunk, asked.experts)
    if same and (stored.experts != "int4" or stored.group == asked.group):
        return
    raise ConfigError(f"--weights/--trunk/--experts ask for {asked} but the checkpoint is quantized as {stored}; "
                      "omit them (it is served as stored) or quantize the float checkpoint again")  # fmt: skip
