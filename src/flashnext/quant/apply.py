"""Quantize a loaded model in memory, part by part, for CPU serving: `--weights {bf16,int8,int4}`,
`--trunk {bf16,int8}`, `--experts {bf16,int8,int4}`.

Parts:
- the dense trunk (`trunk`): every `nn.Linear` of the text model and the MTP head (GDN and QSA projections, the
  indexer's, hyper-connection mixers, PLE key/value, the shared expert and its gate, the router, `lm_head`, MTP's
  fc layers) becomes an `Int8Linear`; same-input `Group`s become one `Int8Group` whose members are row views of
  its weight;
- the routed experts (`experts`): each `Experts` becomes a `QuantExperts` (int8, or int4 with `group`).
Kept as they are: token embeddings and n-gram tables (their own storage: bf16 / FP8 / mmap), norms, convs, the
delta rule's parameters, a vision tower, and `lm_head` when it is tied to the token embedding (an int8 copy would
add bytes, not save them).

Streaming: each module is replaced as soon as it is quantized, so its float tensors are freed then (the extra
memory is one group's or one experts module's quantized copy).

A weight update (a trainer's sync, `serve.weight_update`) of a quantized model arrives under the float names
(`...in_proj_qkv.weight`, `...experts.gate_up_proj`) in the float weight's dtype; `requant_targets` gives a target
for each of those names that requantizes the rows it receives in place (all or nothing is the update's: every piece
is checked before any is written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashnext.checkpoint.int_weights import check_scheme_matches
from flashnext.errors import ConfigError
from flashnext.model.fused import Group
from flashnext.model.moe import Experts, Router
from flashnext.quant.int_experts import QuantExperts
from flashnext.quant.int_linear import Int8Group, Int8Linear, Int8Router

TRUNK_SCHEMES = ("bf16", "int8")
EXPERT_SCHEMES = ("bf16", "int8", "int4")
WEIGHTS = ("bf16", "int8", "int4")
DEFAULT_GROUP = 64


@dataclass(frozen=True)
class QuantScheme:
    """What to quantize: `trunk` ("bf16": as loaded, or "int8"), `experts` ("bf16", "int8", "int4"), the int4
    group size."""

    trunk: str = "bf16"
    experts: str = "bf16"
    group: int = DEFAULT_GROUP

    @classmethod
    def from_flags(cls, weights: str = "bf16", trunk: str | None = None, experts: str | None = None,
                   group: int = DEFAULT_GROUP) -> QuantScheme:  # fmt: skip
        """`--weights` (int8: both parts int8; int4: int4 experts + int8 trunk), overridden per part."""
        if weights not in WEIGHTS:
            raise ConfigError(f"--weights must be one of {list(WEIGHTS)}, got {weights!r}")
        base_trunk = "bf16" if weights == "bf16" else "int8"
        scheme = cls(trunk if trunk is not None else base_trunk, experts if experts is not None else weights, group)
        if scheme.trunk not in TRUNK_SCHEMES:
            raise ConfigError(f"--trunk must be one of {list(TRUNK_SCHEMES)}, got {scheme.trunk!r}")
        if scheme.experts not in EXPERT_SCHEMES:
            raise ConfigError(f"--experts must be one of {list(EXPERT_SCHEMES)}, got {scheme.experts!r}")
        return scheme

    @property
    def enabled(self) -> bool:
        return self.trunk != "bf16" or self.experts != "bf16"

    def __str__(self) -> str:
        g = f" g{self.group}" if self.experts == "int4" else ""
        return f"trunk {self.trunk}, experts {self.experts}{g}"


def _skipped(model: nn.Module) -> set[int]:
    """ids of the modules left alone: the vision tower's, and a `lm_head` tied to the token embedding."""
    skip: set[int] = set()
    visual = getattr(model, "visual", None)
    if isinstance(visual, nn.Module):
        skip |= {id(m) for m in visual.modules()}
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "decoder", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight.data_ptr() == embed.weight.data_ptr():
        skip.add(id(head))
    return skip


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: QuantScheme) -> nn.Module:
    """Replace the parts `scheme` names by their quantized modules, in place; returns `model`.

    Call it on a loaded model before `prepare_for_inference` / building an `Engine`. CPU only.

    Raises:
        ConfigError: a model not on the CPU, an int4 group size that does not fit the experts, or (a model loaded
            from an int8/int4 checkpoint, which stays as stored) a scheme other than the stored one.
    """
    if not scheme.enabled:
        return model
    if (stored := getattr(model, "stored_quant", None)) is not None:  # loaded from an int8/int4 checkpoint
        check_scheme_matches(stored, scheme)
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(f"int8/int4 weights run on the CPU (torch's packed CPU kernels); the model is on {device}")
    skip = _skipped(model)
    names = {id(m): n for n, m in model.named_modules()}  # ids only: no reference keeps a replaced module alive
    if scheme.trunk == "int8":
        _quantize_groups(model, names, skip)
        for name in [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) not in skip]:
            lin = model.get_submodule(name)
            _set(model, name, Int8Linear.from_float(lin.weight, lin.bias))
            del lin
    if scheme.experts != "bf16":
        for name in [n for n, m in model.named_modules() if isinstance(m, Experts)]:
            _set(model, name, QuantExperts.from_float(model.get_submodule(name), scheme.experts, scheme.group))
    return model


def _quantize_groups(model: nn.Module, names: dict[int, str], skip: set[int]) -> None:
    """Every float `Group` -> an `Int8Group`; its members replaced on their parents by the group's row views."""
    owners = [(m, attr) for m in model.modules() for attr, g in vars(m).items() if type(g) is Group]
    for owner, attr in owners:
        group = getattr(owner, attr)
        if any(id(m) in skip for m in group.members):
            continue
        qgroup, members = Int8Group.from_group(group)
        for old, new in zip(group.members, members, strict=True):
            _set(model, names[id(old)], Int8Router(old, new) if isinstance(old, Router) else new)
        setattr(owner, attr, qgroup)
        del group, old


# ---- weight updates into a quantized model ----------------------------------------------------------------------
class RequantTarget:
    """A float tensor name of a quantized module, as a weight update sees it: `dtype` and `shape` of the float
    weight; `write_rows(start, rows)` requantizes those rows (output rows of a linear; experts of an experts module)
    in place and returns the bytes received."""

    def __init__(self, write, shape: tuple[int, ...], dtype: torch.dtype):
        self._write, self.shape, self.dtype = write, torch.Size(shape), dtype

    def dim(self) -> int:
        return len(self.shape)

    def write_rows(self, start: int, rows: torch.Tensor) -> int:
        self._write(start, rows)
        return rows.numel() * rows.element_size()


def requant_targets(model: nn.Module) -> dict[str, RequantTarget]:
    """The float names of every quantized module's weights -> a `RequantTarget` (empty for a float model)."""
    out: dict[str, RequantTarget] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(m, Int8Router):
            m = m.proj
        if isinstance(m, Int8Linear):
            out[f"{prefix}weight"] = RequantTarget(m.write_rows, (m.out_features, m.in_features), m.weight_dtype)
        elif isinstance(m, QuantExperts):
            E, D, I = m.num_experts, m.hidden, m.width
            for which, shape in (("gate_up", (E, 2 * I, D)), ("down", (E, D, I))):
                write = lambda start, w, which=which, m=m: m.write_experts(which, start, w)  # noqa: E731
                out[f"{prefix}{which}_proj"] = RequantTarget(write, shape, m.weight_dtype)
    return out


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (each storage once: group members' views are not counted twice)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
