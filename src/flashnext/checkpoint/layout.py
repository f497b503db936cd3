"""Pure name/shape mapping between the official on-disk checkpoint layout and our state_dict.

Our state_dict matches the in-memory layout of the reference's `Qwen4ExpForCausalLM`; the files on disk differ
in three ways, each handled here without touching tensor data:

- MoE experts are stored one module per expert; we stack them:
  `mlp.experts.{e}.gate_proj.weight [I, D]` -> `mlp.experts.gate_up_proj[e, :I]`,
  `mlp.experts.{e}.up_proj.weight   [I, D]` -> `mlp.experts.gate_up_proj[e, I:]`  (`gate_up_proj: [E, 2I, D]`),
  `mlp.experts.{e}.down_proj.weight [D, I]` -> `mlp.experts.down_proj[e]`         (`down_proj: [E, D, I]`).
- The n-gram table `ple_embedding.ngram_embedding.weight [R, d]` is stored as row chunks
  `ple_embedding.ngram_embedding.shard_{j}.weight`, split like `torch.chunk(table, split_ngram_parts)`.
- Composite (`model_type: qwen4_exp`) checkpoints put the decoder under `model.language_model.*` (the text
  model's `model.*`); `lm_head.*` keeps its name in both layouts.

Other tools write two more spellings, recognised here too:

- Split tensors stored whole under our (the reference's in-memory) name, as `model.state_dict()` saves them:
  `mlp.experts.gate_up_proj [E, 2I, D]`, `mlp.experts.down_proj [E, D, I]`, `ple_embedding.ngram_embedding.weight`
  (`whole_names`); transformers loads these, and so do we.
- Base-model checkpoints (`Qwen4ExpModel` / `Qwen4ExpTextModel.save_pretrained`: `language_model.*` /
  `visual.*`, or `layers.*` / `embed_tokens.*`, no `model.` prefix, no `lm_head`) are recognised
  (`base_model_class`) so the loader can refuse them with one clear error instead of ~200 key problems.

Naming styles (how our names relate to the disk's): `text` (text model <-> text checkpoint, identical names),
`composite` (text model <-> composite checkpoint: our `model.*` is the disk's `model.language_model.*`) and
`multimodal` (`FlashNextForConditionalGeneration` <-> composite checkpoint: identical names, `model.visual.*`
included, since the composite model keeps the reference's in-memory names).

A `Slot` names one on-disk tensor and the region of one of our tensors it fills, so load and save are both
"for each slot: copy `disk <-> ours[slot.index]`".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TEXT = "text"
COMPOSITE = "composite"
MULTIMODAL = "multimodal"

_TEXT_PREFIX = "model."
_COMPOSITE_PREFIX = "model.language_model."
# Tensors our text model does not own but a checkpoint may carry: multi-token-prediction and the vision tower.
EXTRA_PREFIXES = ("mtp.", "model.visual.")

_GATE_UP = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.gate_up_proj$")
_DOWN = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.down_proj$")
# FP8 experts (`model/quant_experts_fp8.py`): the block multipliers of the stacked weights, stored per expert as
# `...experts.{e}.{gate,up,down}_proj.weight_scale_inv` (gate grid rows, then up grid rows, in `gate_up`).
_GATE_UP_SCALE = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.gate_up_proj_scale_inv$")
_DOWN_SCALE = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.down_proj_scale_inv$")
_NGRAM_TABLE = re.compile(r"^(?P<pre>.+\.ple_embedding\.ngram_embedding)\.weight$")
NGRAM_SHARD = re.compile(r"^(?P<pre>.+\.ple_embedding\.ngram_embedding)\.shard_(?P<j>\d+)\.weight$")

# Integer n-gram hash buffers: the reference persists them; our model derives them from the config.
DERIVED_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_DERIVED = re.compile(r"\.ple_embedding\.(" + "|".join(DERIVED_BUFFERS) + r")$")


@dataclass(frozen=True)
class Slot:
    """One on-disk tensor and the region of one of our tensors that it fills.

    Attributes:
        disk_key: name in the safetensors file(s).
        our_key: name in our state_dict.
        shape: on-disk shape; `ours[our_key][index].shape == shape`.
        index: basic-indexing tuple (ints and slices) selecting the region of our tensor; `()` = all of it.
    """

    disk_key: str
    our_key: str
    shape: tuple[int, ...]
    index: tuple = ()


def is_derived_buffer(key: str) -> bool:
    """True for the n-gram hash buffers (`layer_multipliers`, `ngram_heads_*`), in either naming."""
    return _DERIVED.search(key) is not None


def is_extra(disk_key: str) -> bool:
    """True for on-disk tensors that belong to no text-model parameter (`mtp.*`, `model.visual.*`)."""
    return disk_key.startswith(EXTRA_PREFIXES)


def whole_names(our_keys, style: str) -> dict[str, str]:
    """{on-disk name: our name} of the tensors the official layout splits (stacked experts, n-gram tables),
    spelled whole under `style`'s naming, as `model.state_dict()` saves them."""
    out = {}
    for key in our_keys:
        disk = to_disk_name(key, style)
        if _GATE_UP.match(disk) or _DOWN.match(disk) or _NGRAM_TABLE.match(disk):
            out[disk] = key
    return out


# The reference's base models save without the causal LM's `model.` prefix (and without `lm_head`).
_BASE_PREFIXES = (
    ("language_model.", "Qwen4ExpModel"),
    ("layers.", "Qwen4ExpTextModel"),
    ("embed_tokens.", "Qwen4ExpTextModel"),
)


def base_model_class(disk_keys) -> str | None:
    """The reference base-model class whose `save_pretrained` wrote `disk_keys`; None for a causal-LM layout."""
    keys = list(disk_keys)
    if any(k.startswith(("model.", "lm_head.")) for k in keys):
        return None
    return next((cls for prefix, cls in _BASE_PREFIXES if any(k.startswith(prefix) for k in keys)), None)


def to_disk_name(our_key: str, style: str) -> str:
    """Our name -> on-disk name under `style` (`"text"` or `"composite"`), before per-expert/shard splitting."""
    if style == COMPOSITE and our_key.startswith(_TEXT_PREFIX):
        return _COMPOSITE_PREFIX + our_key[len(_TEXT_PREFIX) :]
    return our_key


def from_disk_name(disk_key: str, style: str) -> str | None:
    """On-disk name -> our name (before expert/shard merging); None when `disk_key` is outside the layout."""
    if style == COMPOSITE:
        if disk_key.startswith(_COMPOSITE_PREFIX):
            return _TEXT_PREFIX + disk_key[len(_COMPOSITE_PREFIX) :]
        return disk_key if disk_key.startswith("lm_head.") else None
    return disk_key


def model_style(our_keys) -> str | None:
    """`"multimodal"` when our names already carry `model.language_model.` (the composite model), else None."""
    return MULTIMODAL if any(k.startswith(_COMPOSITE_PREFIX) for k in our_keys) else None


def embed_name(our_keys) -> str:
    """Our token-embedding name: `model.language_model.embed_tokens.weight` (composite model) or the text one."""
    return _COMPOSITE_PREFIX + "embed_tokens.weight" if model_style(our_keys) else _TEXT_PREFIX + "embed_tokens.weight"


def detect_style(disk_keys) -> str:
    """`"composite"` when any key lives under `model.language_model.`, else `"text"`."""
    return COMPOSITE if any(k.startswith(_COMPOSITE_PREFIX) for k in disk_keys) else TEXT


def ngram_shard_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """Row ranges `[start, stop)` of the n-gram table's shards, exactly as `torch.chunk(table, parts)` cuts them.

    Every chunk has `ceil(rows / parts)` rows except a shorter last one, so fewer than `parts` chunks come out
    when `parts` does not divide `rows` evenly enough (e.g. 16 rows, 5 parts -> 4 chunks of 4).
    """
    if rows <= 0 or parts <= 0:
        return [(0, rows)] if rows > 0 else []
    step = -(-rows // parts)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def slots_for(our_key: str, shape: tuple[int, ...], *, style: str, split_ngram_parts: int) -> list[Slot]:
    """The on-disk tensors that make up our tensor `our_key` of `shape`, in on-disk naming `style`.

    Args:
        our_key: our state_dict name.
        shape: our tensor's shape.
        style: `"text"` or `"composite"`.
        split_ngram_parts: the config's `split_ngram_parts` (used for n-gram tables only).
    """
    shape = tuple(shape)
    disk = to_disk_name(our_key, style)
    if m := _GATE_UP.match(disk):
        return _gate_up_slots(our_key, m["pre"], shape, ".weight")
    if m := _DOWN.match(disk):
        return [Slot(f"{m['pre']}.{e}.down_proj.weight", our_key, shape[1:], (e,)) for e in range(shape[0])]
    if m := _GATE_UP_SCALE.match(disk):
        return _gate_up_slots(our_key, m["pre"], shape, ".weight_scale_inv")
    if m := _DOWN_SCALE.match(disk):
        return [Slot(f"{m['pre']}.{e}.down_proj.weight_scale_inv", our_key, shape[1:], (e,)) for e in range(shape[0])]
    if m := _NGRAM_TABLE.match(disk):
        return ngram_slots(our_key, m["pre"], shape, ngram_shard_rows(shape[0], split_ngram_parts))
    return [Slot(disk, our_key, shape)]


def _gate_up_slots(our_key: str, disk_pre: str, shape: tuple[int, ...], suffix: str) -> list[Slot]:
    """Per-expert gate / up slots of a stacked `[E, 2H, C]` tensor: rows `[:H]` are gate, `[H:]` up."""
    n_exp, two_h, cols = shape
    half = two_h // 2
    out = []
    for e in range(n_exp):
        base = f"{disk_pre}.{e}"
        out.append(Slot(f"{base}.gate_proj{suffix}", our_key, (half, cols), (e, slice(0, half))))
        out.append(Slot(f"{base}.up_proj{suffix}", our_key, (half, cols), (e, slice(half, two_h))))
    return out


def ngram_slots(our_key: str, disk_pre: str, shape: tuple[int, ...], rows: list[tuple[int, int]]) -> list[Slot]:
    """Slots for an n-gram table `[R, d]` stored as shards covering the row ranges `rows` (in shard order)."""
    return [
        Slot(f"{disk_pre}.shard_{j}.weight", our_key, (b - a, *shape[1:]), (slice(a, b),))
        for j, (a, b) in enumerate(rows)
    ]


def table_key_of_shard(disk_key: str, style: str) -> tuple[str, int] | None:
    """For an n-gram shard's on-disk name: (our table name, shard index j); None for any other key."""
    m = NGRAM_SHARD.match(disk_key)
    if m is None:
        return None
    ours = from_disk_name(m["pre"] + ".weight", style)
    return (ours, int(m["j"])) if ours is not None else None


def build_plan(our_shapes: dict[str, tuple[int, ...]], *, style: str, split_ngram_parts: int) -> dict[str, Slot]:
    """Every on-disk tensor our model's tensors map to: `{disk_key: Slot}`, in our state_dict order.

    Args:
        our_shapes: our state_dict names -> shapes; derived n-gram buffers are skipped if present.
        style: `"text"` or `"composite"`.
        split_ngram_parts: the config's `split_ngram_parts`.
    """
    plan: dict[str, Slot] = {}
    for key, shape in our_shapes.items():
        if is_derived_buffer(key):
            continue
        for slot in slots_for(key, shape, style=style, split_ngram_parts=split_ngram_parts):
            plan[slot.disk_key] = slot
    return plan
