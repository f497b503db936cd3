"""Loading an int8 / int4 checkpoint (`flashnext quantize --weights int8|int4`; its format and checks:
`checkpoint/int_weights.py`) straight into the quantized modules, with no float copy of a quantized part.

`build.from_pretrained`: `use_int_modules` checks every header against the modules the stored scheme quantizes
(`int_modules`: the same choice as `quant.apply.quantize_model`) and swaps them for `Int8Linear` / `Int8Router` /
`QuantExperts` on the meta device, so allocation makes only the quantized buffers; `load_checkpoint` fills the rest
and `fill_int_modules` copies the codes in tensor by tensor (int4: one expert's codes unpacked and packed at a
time), then joins same-input projections into `Int8Group`s. The loaded model equals `quantize_model` of the float
checkpoint bitwise: the same quantisation functions made the codes, the same kernels run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flashnext.checkpoint.files import StreamReader, checkpoint_files, read_headers
from flashnext.checkpoint.int_weights import (
    QUANT_KEY,
    IntScheme,
    code_shapes,
    disk_module,
    expert_matrices,
    unpack_nibbles,
)
from flashnext.errors import CheckpointError, ConfigError
from flashnext.model.fused import Group
from flashnext.model.moe import Experts, Router
from flashnext.quant.apply import QuantScheme
from flashnext.quant.apply import _skipped as apply_skipped
from flashnext.quant.int_experts import QuantExperts, pack_int4
from flashnext.quant.int_linear import Int8Group, Int8Linear, Int8Router, compute_dtype


def _skipped(model: nn.Module) -> set[int]:
    """`quant.apply._skipped` on a model that may be on `meta`: the vision tower, a `lm_head` tied to the embedding
    (the same Parameter, or the same storage once allocated)."""
    skip = apply_skipped(model) if next(model.parameters()).device.type != "meta" else set()
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


@dataclass
class IntLoad:
    """What `use_int_modules` set up for `fill_int_modules` and `load_checkpoint`."""

    scheme: IntScheme
    style: str
    modules: dict[str, str]  # our name -> "linear" / "experts"
    groups: list = field(default_factory=list)  # (owner module, attribute, [member names])
    skip_ours: frozenset = frozenset()  # our tensor names fill_int_modules fills
    skip_disk: frozenset = frozenset()  # the disk keys it reads
    headers: dict = field(default_factory=dict)  # the checkpoint's headers, read once (`read_headers`)


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
    return IntLoad(scheme, style, ours, groups, frozenset(filled), frozenset(disk_keys), headers)


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
def fill_int_modules(model: nn.Module, load: IntLoad) -> None:
    """Copy the codes, scales (and biases) into the quantized modules `use_int_modules` made, tensor by tensor; then
    join same-input projections into `Int8Group`s and record the scheme on `model.stored_quant`."""
    headers = load.headers
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
    model.stored_quant = QuantScheme(load.scheme.trunk, load.scheme.experts, load.scheme.group)


def _fill_experts(reader: StreamReader, headers: dict, mod, pre: str) -> None:
    """One `QuantExperts` from its per-expert tensors: int8 copied into place; int4 one expert at a time (gate and
    up codes unpacked, joined as `gate_up`, packed by the kernel's packer, as `QuantExperts.write_experts` does)."""

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
