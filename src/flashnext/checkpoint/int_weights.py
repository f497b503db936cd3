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

Loading (`build.from_pretrained`): `int_checkpoint` parses the config; `use_int_modules` swaps the listed modules for
`Int8Linear` / `Int8Router` / `QuantExperts` on the meta device after checking every header (one `CheckpointError`
listing each key at fault: codes without scales, mis-shaped or mis-typed tensors, a listed module with no tensors,
a float weight left beside codes, an unknown scheme or group), so allocation makes only the quantized buffers;
`load_checkpoint` fills the rest and `fill_int_modules` copies the codes in tensor by tensor (int4: one expert's
codes unpacked and packed at a time), then joins same-input projections into `Int8Group`s. The loaded model equals
`quantize_model` of the float checkpoint bitwise: the same quantisation functions made the codes, the same kernels
run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import StreamReader, checkpoint_files, read_headers
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

    def quant_scheme(self):
        from flashnext.quant.apply import QuantScheme

        return QuantScheme(self.trunk, self.experts, self.group)


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


# ---- which modules: the same choice as `quant.apply.quantize_model` ---------------------------------------------
def _skipped(model: nn.Module) -> set[int]:
    """`quant.apply._skipped` on a model that may be on `meta`: the vision tower, a `lm_head` tied to the embedding
    (the same Parameter, or the same storage once allocated)."""
    from flashnext.quant.apply import _skipped as allocated_skips

    skip = allocated_skips(model) if next(model.parameters()).device.type != "meta" else set()
    visual = getattr(model, "visual", None)
    if isinstance(visual, nn.Module):
        skip |= {id(m) for m in visual.modules()}
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "decoder", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight is embed.weight:
        skip.add(id(head))
    return skip


def int_modules(model: nn.Module, trunk: str, experts: str) -> dict[str, str]:
    """{our module name: "linear" / "experts"} that `quantize_model` replaces for these part schemes."""
    from flashnext.model.fused import Group
    from flashnext.model.moe import Experts

    skip = _skipped(model)
    out: dict[str, str] = {}
    if trunk == "int8":
        names = {id(m): n for n, m in model.named_modules()}
        for m in model.modules():
            for g in vars(m).values():
                if type(g) is Group and not any(id(x) in skip for x in g.members):
                    out.update({names[id(x)]: "linear" for x in g.members})
        out.update({n: "linear" for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in skip})
    if experts != "bf16":
        out.update({n: "experts" for n, m in model.named_modules() if isinstance(m, Experts)})
    return out


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


# ---- loading -----------------------------------------------------------------------------------------------------
@dataclass
class IntLoad:
    """What `use_int_modules` set up for `fill_int_modules` and `load_checkpoint`."""

    scheme: IntScheme
    style: str
    modules: dict[str, str]  # our name -> "linear" / "experts"
    groups: list = field(default_factory=list)  # (owner module, attribute, [member names])
    skip_ours: frozenset = frozenset()  # our tensor names fill_int_modules fills
    skip_disk: frozenset = frozenset()  # the disk keys it reads


def use_int_modules(
    model: nn.Module, path: str | Path, scheme: IntScheme, style: str, dtype: torch.dtype, device="cpu"
) -> IntLoad:
    """Check the checkpoint's headers against the modules `scheme` quantizes in `model` (on meta), then swap those
    for quantized modules on meta (see the module doc).

    Raises:
        ConfigError: a `device` other than the CPU (torch's packed int8/int4 kernels are CPU kernels).
        CheckpointError: every problem, each naming its key (see the module doc).
    """
    if torch.device(device).type != "cpu":
        raise ConfigError(f"an int8/int4 checkpoint runs on the CPU (torch's packed CPU kernels); asked for {device}")
    from flashnext.model.fused import Group
    from flashnext.model.moe import Router
    from flashnext.quant.int_experts import QuantExperts
    from flashnext.quant.int_linear import Int8Linear, Int8Router, compute_dtype

    files, weight_map = checkpoint_files(path)
    headers, _, _ = read_headers(files, weight_map)  # unreadable files: the loader reports them
    ours = int_modules(model, scheme.trunk, scheme.experts)
    problems, disk_keys = _check(model, ours, scheme, style, headers)
    if problems:
        raise CheckpointError(f"cannot load int checkpoint {str(path)!r} ({len(problems)} problem(s))", problems)
    cdtype = compute_dtype(dtype)
    names = {id(m): n for n, m in model.named_modules()}
    groups = [(m, attr, [names[id(x)] for x in g.members]) for m in model.modules() for attr, g in vars(m).items()
              if type(g) is Group and all(names[id(x)] in ours for x in g.members)]  # fmt: skip
    with torch.device("meta"):
        for name, kind in ours.items():
            old = model.get_submodule(name)
            if kind == "experts":
                E, two_i, D = old.gate_up_proj.shape
                new = QuantExperts(scheme.experts, E, D, two_i // 2, cdtype, dtype, scheme.group)
            else:
                N, K = old.weight.shape
                bias = getattr(old, "bias", None)
                new = Int8Linear(torch.empty(N, K, dtype=torch.int8), torch.empty(N, dtype=cdtype),
                                 None if bias is None else torch.empty(N, dtype=bias.dtype), dtype)  # fmt: skip
                new = Int8Router(old, new) if isinstance(old, Router) else new
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    filled = {f"{n}.{k}" for n in ours for k in model.get_submodule(n).state_dict(keep_vars=True)}
    return IntLoad(scheme, style, ours, groups, frozenset(filled), frozenset(disk_keys))


def _check(model, ours: dict[str, str], scheme: IntScheme, style: str, headers: dict) -> tuple[list[str], set[str]]:
    """(problems, the disk keys of the quantized modules) of the headers against the modules `ours`."""
    problems: list[str] = []
    want: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}  # disk key -> (shape, dtypes)
    declared = {disk_module(n, k, style): (n, k) for n, k in ours.items()}
    for disk, (name, kind) in declared.items():
        s = scheme.experts if kind == "experts" else scheme.trunk
        if scheme.modules.get(disk) != s:
            found = scheme.modules.get(disk)
            problems.append(f"undeclared: {disk} is {s} for trunk {scheme.trunk} / experts {scheme.experts}, but "
                            f"{QUANT_KEY}.modules lists it as {found or 'nothing'}")  # fmt: skip
        mod = model.get_submodule(name)
        if kind == "experts":
            E, two_i, D = mod.gate_up_proj.shape
            mats = expert_matrices(disk, E, D, two_i // 2)
        else:
            mats = [(disk, *mod.weight.shape)]
            if getattr(mod, "bias", None) is not None:
                want[f"{disk}.bias"] = (tuple(mod.bias.shape), ("BF16", "F16", "F32"))
        for m, N, K in mats:
            if s == "int4" and K % scheme.group:
                problems.append(f"group: {m} has {K} inputs, not a multiple of group_size {scheme.group}")
                continue
            want.update({m + suf: v for suf, v in code_shapes(s, N, K, scheme.group).items()})
    extra = sorted(set(scheme.modules) - set(declared))
    problems += [f"unexpected: {QUANT_KEY}.modules lists {m}, which this model does not quantize" for m in extra]
    for key, (shape, dtypes) in want.items():
        if key not in headers:
            what = "the codes need their scales" if not key.endswith(".qweight") else "its scales need these codes"
            problems.append(f"missing: {key} ({what}; {list(shape)} {'/'.join(dtypes)})")
        elif tuple(headers[key][1]) != shape or headers[key][2] not in dtypes:
            got = f"{list(headers[key][1])} {headers[key][2]}"
            problems.append(f"mis-shaped: {key} is {got}, expected {list(shape)} {'/'.join(dtypes)}")
    for disk in declared:
        for suffix in (".weight", ".gate_up_proj", ".down_proj", ".0.gate_proj.weight"):
            if disk + suffix in headers:
                problems.append(f"unexpected: {disk + suffix} is a float weight of the quantized module {disk}")
    return problems, set(want)


@torch.no_grad()
def fill_int_modules(model: nn.Module, path: str | Path, load: IntLoad) -> None:
    """Copy the codes, scales (and biases) into the quantized modules `use_int_modules` made, tensor by tensor; then
    join same-input projections into `Int8Group`s and record the scheme on `model.stored_quant`."""
    from flashnext.quant.int_linear import Int8Group, Int8Router

    files, weight_map = checkpoint_files(path)
    headers, _, _ = read_headers(files, weight_map)
    reader = StreamReader()
    try:
        for name, kind in load.modules.items():
            mod = model.get_submodule(name)
            disk = disk_module(name, kind, load.style)
            if kind == "experts":
                _fill_experts(reader, headers, mod, disk)
                continue
            mod = mod.proj if isinstance(mod, Int8Router) else mod
            for suffix, dest in ((".qweight", mod.qweight), (".weight_scale", mod.scale), (".bias", mod.bias)):
                if dest is not None:
                    reader.copy_into(headers[disk + suffix][0], disk + suffix, dest)
    finally:
        reader.close()
    for owner, attr, members in load.groups:
        mods = [model.get_submodule(n) for n in members]
        setattr(owner, attr, Int8Group.from_members([m.proj if isinstance(m, Int8Router) else m for m in mods]))
    model.stored_quant = load.scheme.quant_scheme()


def _fill_experts(reader: StreamReader, headers: dict, mod, pre: str) -> None:
    """One `QuantExperts` from its per-expert tensors: int8 copied into place; int4 one expert at a time (gate and
    up codes unpacked, joined as `gate_up`, packed by the kernel's packer, as `QuantExperts.write_experts` does)."""
    from flashnext.quant.int_experts import pack_int4

    I = mod.width

    def read(key):
        f, shape, dtype = headers[key]
        return reader.read_full(f, key, tuple(shape), dtype)

    for e in range(mod.num_experts):
        if mod.scheme == "int8":
            for proj, qdest, sdest in (("gate_proj", mod.gate_up_q[e, :I], mod.gate_up_s[e, :I]),
                                       ("up_proj", mod.gate_up_q[e, I:], mod.gate_up_s[e, I:]),
                                       ("down_proj", mod.down_q[e], mod.down_s[e])):  # fmt: skip
                key = f"{pre}.{e}.{proj}"
                reader.copy_into(headers[key + ".qweight"][0], key + ".qweight", qdest)
                reader.copy_into(headers[key + ".weight_scale"][0], key + ".weight_scale", sdest)
            continue
        for which, projs in (("gate_up", ("gate_proj", "up_proj")), ("down", ("down_proj",))):
            keys = [f"{pre}.{e}.{p}" for p in projs]
            codes = torch.cat([unpack_nibbles(read(k + ".qweight")) for k in keys])
            scale = torch.cat([read(k + ".weight_scale") for k in keys])
            zero = torch.cat([read(k + ".weight_zero") for k in keys])
            getattr(mod, f"{which}_q")[e].copy_(pack_int4(codes))
            sz = getattr(mod, f"{which}_s")
            sz[e].copy_(torch.stack([scale.to(sz.dtype), zero.to(sz.dtype)], -1).transpose(0, 1))


def check_scheme_matches(stored, asked) -> None:
    """Raise `ConfigError` when serving flags ask for another scheme than the checkpoint stores (`QuantScheme`s)."""
    same = (stored.trunk, stored.experts) == (asked.trunk, asked.experts)
    if same and (stored.experts != "int4" or stored.group == asked.group):
        return
    raise ConfigError(f"--weights/--trunk/--experts ask for {asked} but the checkpoint is quantized as {stored}; "
                      "omit them (it is served as stored) or quantize the float checkpoint again")  # fmt: skip
