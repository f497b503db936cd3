"""Load an official-layout checkpoint into an already-allocated model, one tensor at a time.

Each on-disk tensor is copied straight into its slice of our parameter (`gate_up_proj[e, :I]`, a row range of
an n-gram table, ...), cast to the parameter's dtype on the way; no state dict and no second copy of any
table is ever built. The whole key set is validated before anything is copied. Split tensors may also be
stored whole (`layout.whole_names`: stacked experts, one n-gram table), as `model.state_dict()` writes them.
A base-model checkpoint (no `lm_head`, no `model.` prefix) is refused with one error: it cannot give logits.

Tensors the text model does not own (`mtp.*`, and `model.visual.*` when the model has no vision tower) are
read into `model.extra_tensors: dict[str, Tensor]` (on-disk names, stored dtype, CPU) so `save_pretrained`
can write them back.

The n-gram hash buffers (`layer_multipliers`, `ngram_heads_vocab_sizes`, `ngram_heads_offsets`) are derived
from the config by our model. When the checkpoint carries them they are *verified* against the model's
buffers (a mismatch is an error: the hash would silently differ); when it does not, that is fine.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import StreamReader, checkpoint_files, is_float_dtype, read_headers
from flashnext.checkpoint.ngram_tables import NGRAM_SCALE, external_keys, fp8_problems, scale_key
from flashnext.errors import CheckpointError

PREFIX_STYLES = ("auto", layout.TEXT, layout.COMPOSITE, layout.MULTIMODAL)
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_NOT_FP8 = "not FP8 (only routed experts load as FP8, declared by config.json's quantization_config)"


def shares_embedding(tensors: dict[str, torch.Tensor]) -> bool:
    """True when `lm_head.weight` shares storage with the token embedding (physically tied)."""
    head, emb = tensors.get(HEAD), tensors.get(layout.embed_name(tensors))
    return head is not None and emb is not None and head.data_ptr() == emb.data_ptr()


def ties_embeddings(cfg) -> bool:
    """`tie_word_embeddings` of a `ModelConfig` (text or top level) or of any config object carrying it."""
    if hasattr(cfg, "text") and hasattr(cfg, "top"):
        return bool(cfg.text.tie_word_embeddings or cfg.top.get("tie_word_embeddings", False))
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _describe(shape, dtype) -> str:
    return f"{list(shape)} {dtype}"


class _Matcher:
    """Sorts on-disk keys into slots of our tensors, n-gram shards, derived buffers, extras and problems."""

    def __init__(
        self, ours: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], style: str, tie: bool, external=()
    ):
        self.ours, self.buffers, self.style = ours, buffers, style
        self.external = set(external)  # keys of on-disk (`mmap`) n-gram tables: read by the table, not copied
        self.scales: dict[str, str] = {}  # our dense table -> FP8 scale key: the shards are dequantised into it
        self.shared = shares_embedding(ours)
        self.embed = layout.embed_name(ours)
        self.tie = tie or self.shared
        plan = layout.build_plan({k: t.shape for k, t in ours.items()}, style=style, split_ngram_parts=1)
        self.tables = {s.our_key: s for s in plan.values() if layout.NGRAM_SHARD.match(s.disk_key)}
        self.plan = {k: s for k, s in plan.items() if s.our_key not in self.tables}
        if self.shared:
            self.plan.pop(HEAD, None)  # loading the embedding fills both
        self.whole = layout.whole_names(ours, style)  # {disk name: our key}, split tensors stored whole
        self.whole_found: dict[str, str] = {}  # our key -> its whole on-disk key
        self.slots: list[layout.Slot] = []
        self.shards: dict[str, dict[int, str]] = defaultdict(dict)
        self.derived: list[tuple[str, str]] = []  # (disk key, our buffer name)
        self.extras: list[str] = []
        self.problems: list[str] = []

    def add(self, key: str, shape: tuple[int, ...], dtype: str) -> None:
        if key in self.external:
            return
        if key in self.plan:
            slot = self.plan[key]
            dest = self.ours[slot.our_key]
            if shape != slot.shape:
                self.problems.append(f"mis-shaped: {key} is {_describe(shape, dtype)}, expected {list(slot.shape)}")
            elif dest.is_floating_point() != is_float_dtype(dtype):
                want = "floating point" if dest.is_floating_point() else str(dest.dtype)
                self.problems.append(f"wrong dtype: {key} is {_describe(shape, dtype)}, expected {want}")
            elif (dest.dtype in _FP8_DTYPES) != dtype.startswith("F8_"):  # a cast would drop the block scales
                want = "F8_E4M3 (the model keeps it in FP8)" if dest.dtype in _FP8_DTYPES else _NOT_FP8
                self.problems.append(f"wrong dtype: {key} is {_describe(shape, dtype)}, expected {want}")
            else:
                self.slots.append(slot)
        elif key in self.whole:
            self._add_whole(key, shape, dtype)
        elif (shard := layout.table_key_of_shard(key, self.style)) and shard[0] in self.tables:
            self.shards[shard[0]][shard[1]] = key
        elif (m := NGRAM_SCALE.match(key)) and (table := layout.from_disk_name(m["pre"] + ".weight", self.style)):
            if table not in self.tables:
                self.problems.append(f"unexpected: {key} {_describe(shape, dtype)}")
        elif layout.is_derived_buffer(key) and (name := layout.from_disk_name(key, self.style)) is not None:
            self._add_derived(key, name, shape, dtype)
        elif layout.is_extra(key):
            self.extras.append(key)
        elif key == HEAD and self.shared:
            pass  # physically tied: the embedding already holds these values
        else:
            self.problems.append(f"unexpected: {key} {_describe(shape, dtype)}")

    def _add_whole(self, key: str, shape: tuple[int, ...], dtype: str) -> None:
        our_key = self.whole[key]
        self.whole_found[our_key] = key  # present, even if mis-shaped: its split keys are not "missing"
        want = tuple(self.ours[our_key].shape)
        fp8_experts = dtype.startswith("F8_") and our_key not in self.tables  # whole FP8 experts: no block scales
        if shape != want or not is_float_dtype(dtype) or fp8_experts:
            self.problems.append(
                f"mis-shaped: {key} is {_describe(shape, dtype)}, expected {list(want)} floating point"
            )
        else:
            self.slots.append(layout.Slot(key, our_key, want))

    def _add_derived(self, key: str, name: str, shape: tuple[int, ...], dtype: str) -> None:
        buf = self.buffers.get(name)
        if buf is None:
            return  # a model without this buffer derives nothing to check against
        if is_float_dtype(dtype) or shape != tuple(buf.shape):
            self.problems.append(f"mis-shaped: {key} is {_describe(shape, dtype)}, expected {list(buf.shape)} integer")
        else:
            self.derived.append((key, name))

    def finish(self, headers: dict, lost: set[str]) -> None:
        """Resolve n-gram shards into row slots and list missing keys (`lost` ones sit in unreadable files)."""
        embed = layout.to_disk_name(self.embed, self.style)
        if self.tie and HEAD in self.plan and HEAD not in headers and embed in headers:
            # Tied checkpoints omit lm_head (as transformers saves them): fill it from the embedding.
            self.slots.append(layout.Slot(embed, HEAD, self.plan.pop(HEAD).shape))
        whole = set(self.whole_found) | {self.whole[k] for k in lost if k in self.whole}
        self.problems += [
            f"missing: {k} {list(s.shape)}"
            for k, s in self.plan.items()
            if k not in headers and k not in lost and s.our_key not in whole
        ]
        split_too = {s.our_key for k, s in self.plan.items() if s.our_key in self.whole_found and k in headers}
        split_too |= {t for t in self.tables if t in self.whole_found and self.shards.get(t)}
        self.problems += [f"duplicate: {self.whole_found[k]} is stored both whole and split" for k in sorted(split_too)]
        for table, first in self.tables.items():
            disk_pre = first.disk_key.rsplit(".shard_", 1)[0]
            if table in self.whole_found:  # stored whole (state-dict layout): the FP8 checks of that one tensor
                key = self.whole_found[table]
                self.problems += self._fp8_problems(table, disk_pre, {key: headers[key][2]}, headers)
            if table in whole:
                continue
            if not any(k.startswith(disk_pre + ".shard_") for k in lost):
                self._table_slots(table, disk_pre, headers)

    def _table_slots(self, table: str, disk_pre: str, headers: dict) -> None:
        shape = tuple(self.ours[table].shape)
        found = self.shards.get(table, {})
        if not found:
            self.problems.append(f"missing: {disk_pre}.shard_*.weight (n-gram table {table} {list(shape)})")
            return
        order = sorted(found)
        gaps = sorted(set(range(order[-1] + 1)) - set(order))
        if gaps:
            self.problems += [f"missing: {disk_pre}.shard_{j}.weight (shards present: {order})" for j in gaps]
            return
        rows, start, bad = [], 0, []
        for j in order:
            s_shape, s_dtype = headers[found[j]][1:]
            if len(s_shape) != len(shape) or s_shape[1:] != shape[1:] or not is_float_dtype(s_dtype):
                bad.append(f"mis-shaped: {found[j]} is {_describe(s_shape, s_dtype)}, expected [*, {shape[1]}]")
            n_rows = s_shape[0] if s_shape else 0
            rows.append((start, start + n_rows))
            start += n_rows
        if not bad and start != shape[0]:
            bad.append(f"mis-shaped: {disk_pre}.shard_* hold {start} rows, n-gram table {table} has {shape[0]}")
        if not bad:
            bad = self._fp8_problems(table, disk_pre, {found[j]: headers[found[j]][2] for j in order}, headers)
        self.problems += bad
        if not bad:
            self.slots += layout.ngram_slots(table, disk_pre, shape, rows)

    def _fp8_problems(self, table: str, disk_pre: str, dtypes: dict[str, str], headers: dict) -> list[str]:
        """FP8 layout checks; a dense table from FP8 shards records its scale, an FP8 one needs FP8 shards."""
        problems = fp8_problems(disk_pre, dtypes, headers)
        fp8_disk = "F8_E4M3" in dtypes.values()
        if problems:
            return problems
        if self.ours[table].dtype == torch.float8_e4m3fn and not fp8_disk:
            stored = sorted(set(dtypes.values()))
            return [f"wrong dtype: {disk_pre} is stored as {stored}, but the model keeps {table} in FP8"]
        if fp8_disk and self.ours[table].dtype != torch.float8_e4m3fn:
            self.scales[table] = scale_key(disk_pre)
        return []


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(our state_dict tensors without the derived n-gram buffers, every named buffer incl. non-persistent)."""
    ours = {k: v for k, v in model.state_dict(keep_vars=True).items() if not layout.is_derived_buffer(k)}
    return ours, dict(model.named_buffers())


@torch.no_grad()
def load_checkpoint(
    model: torch.nn.Module,
    path: str | Path,
    *,
    prefix_style: str = "auto",
    skip_ours: frozenset[str] = frozenset(),
    skip_disk: frozenset[str] = frozenset(),
) -> None:
    """Copy an official-layout checkpoint into `model`'s allocated parameters, one tensor at a time.

    Args:
        model: a model whose state_dict follows the reference's in-memory names and shapes, already allocated
            on its final device and dtype (each tensor is cast to its parameter's dtype while copying).
        path: a checkpoint directory (`model.safetensors`, or shards + `model.safetensors.index.json`) or
            one `.safetensors` file.
        prefix_style: `"text"` (`model.*`), `"composite"` (`model.language_model.*` into a text model),
            `"multimodal"` (a composite checkpoint into `FlashNextForConditionalGeneration`: identical names), or
            `"auto"` (multimodal for the composite model, else composite when any key is under
            `model.language_model.`, else text).
        skip_ours, skip_disk: our tensor names and the on-disk keys another loader fills / reads (the quantized
            modules of an int checkpoint, `checkpoint/int_weights.py`): neither expected nor unexpected here.

    Sets `model.extra_tensors` (see module doc) and `model.checkpoint_style` (the layout that was read).

    Raises:
        CheckpointError: before copying anything, listing every missing, unexpected, mis-shaped, wrong-dtype
            or duplicated (stored whole and split) key, every unreadable (truncated/corrupt) file and every
            mismatched derived buffer; or, alone, for a base-model checkpoint (no `lm_head`).
    """
    if prefix_style not in PREFIX_STYLES:
        raise CheckpointError(f"prefix_style={prefix_style!r}: expected one of {PREFIX_STYLES}")
    files, weight_map = checkpoint_files(path)
    headers, problems, lost = read_headers(files, weight_map)
    _refuse_base_model(path, headers)
    ours, buffers = _model_tensors(model)
    ours = {k: v for k, v in ours.items() if k not in skip_ours}
    style = (layout.model_style(ours) or layout.detect_style(headers)) if prefix_style == "auto" else prefix_style
    cfg = getattr(model, "model_config", None) or getattr(model, "config", None)
    match = _Matcher(ours, buffers, style, ties_embeddings(cfg), set(external_keys(model)) | set(skip_disk))
    for key, (_, shape, dtype) in headers.items():
        match.add(key, shape, dtype)
    match.finish(headers, lost)
    problems += match.problems
    reader = StreamReader()
    try:
        if not problems:
            problems += _check_derived(reader, headers, match.derived, buffers)
        if problems:
            raise CheckpointError(f"cannot load checkpoint {str(path)!r} ({len(problems)} problem(s))", problems)
        for slot in sorted(match.slots, key=lambda s: str(headers[s.disk_key][0])):
            dest = ours[slot.our_key].data[slot.index]
            reader.copy_into(headers[slot.disk_key][0], slot.disk_key, dest)
            if slot.our_key in match.scales:  # FP8 shard into a dense table: upcast this shard only
                scale = reader.read_small(headers[match.scales[slot.our_key]][0], match.scales[slot.our_key])
                dest.mul_(scale.to(dest.device, dest.dtype))  # == dequantize_rows: rows.to(dtype) * scale.to(dtype)
        model.extra_tensors = {k: reader.read_full(headers[k][0], k, *headers[k][1:]) for k in match.extras}
    finally:
        reader.close()
    model.checkpoint_style = style


def _refuse_base_model(path: str | Path, headers: dict) -> None:
    if base := layout.base_model_class(headers):
        raise CheckpointError(
            f"cannot load checkpoint {str(path)!r}: it is a base-model checkpoint ({base}.save_pretrained: keys "
            f"like {min(headers)!r}, no 'model.' prefix) without lm_head.weight, so it cannot give logits; "
            "save the causal LM that owns the head (Qwen4ExpForCausalLM / Qwen4ExpForConditionalGeneration) "
            "instead of its base model"
        )


def _check_derived(reader: StreamReader, headers: dict, derived: list[tuple[str, str]], buffers: dict) -> list[str]:
    problems = []
    for key, name in derived:
        stored, ours = reader.read_small(headers[key][0], key), buffers[name]
        if not torch.equal(stored.to(ours.device, ours.dtype), ours):
            problems.append(f"mismatch: {key} = {stored.tolist()} but the config derives {ours.tolist()}")
    return problems
