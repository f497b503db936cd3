"""`flashnext quantize --weights fp8 IN OUT`: a checkpoint in the official FP8 layout (Qwen3.8-Flash-Next-FP8).

What is written (`checkpoint/fp8_weights.py` reads it back):
- every routed expert of the trunk, `...mlp.experts.{e}.{gate,up,down}_proj.weight`, becomes F8_E4M3 with a BF16
  `...weight_scale_inv` holding one multiplier per 128 x 128 block (`ops.fp8_blocks.quantize_blocks`), written
  right after its weight in the same file;
- every n-gram table becomes F8_E4M3 shards with one BF16 `...ngram_embedding.weight_scale` of shape [1]
  (`amax / 448` over the table, rounded to BF16); a table already in FP8 is copied as it is;
- every other tensor (the MTP head's experts included) is copied byte for byte;
- `config.json` gains `quantization_config` (quant_method fp8, dynamic activations, [128, 128] blocks,
  `modules_to_convert` = the n-gram table, `modules_to_not_convert` = every other matrix by full name), which is
  what transformers reads to dequantise it; the other files (tokenizer) are copied.

Streamed: an expert is one tensor read, quantised and written before the next is read (peak: one expert and its
output); tables go by `PIECE_BYTES` of rows as in `checkpoint/quantize.py`. OUT must be absent or empty unless
`overwrite`, which replaces it whole (`checkpoint/target.py`): nothing of what OUT held survives.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import INDEX_FILE, TORCH_DTYPES, checkpoint_files, data_offsets
from flashnext.checkpoint.fp8 import fp8_scale, quantize_fp8
from flashnext.checkpoint.fp8_weights import EXPERT_WEIGHT, QUANT_KEY, SCALE_SUFFIX, quantization_config
from flashnext.checkpoint.ngram_tables import scale_key
from flashnext.checkpoint.quantize import PIECE_BYTES, _amax, _raw_chunks, _tables, check_quantize_target, row_chunks
from flashnext.checkpoint.stream_write import Entry, write_safetensors
from flashnext.checkpoint.target import writing
from flashnext.config import load_config
from flashnext.errors import CheckpointError
from flashnext.ops.fp8_blocks import BLOCK, quantize_blocks, scale_grid

WEIGHT_SCHEMES = ("fp8",)
_SOURCE_DTYPES = ("BF16", "F16", "F32")
NGRAM_MODULE = "ple.ple_embedding.ngram_embedding"  # the official modules_to_convert entry (a name suffix)


def fp8_quantization_config(not_convert: list[str], has_tables: bool) -> dict:
    """The `quantization_config` object of the official FP8 checkpoint."""
    return {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_per_tensor": False, "act_per_tensor": False,
        "weight_block_size": [BLOCK, BLOCK], "modules_to_convert": [NGRAM_MODULE] if has_tables else [],
        "modules_to_not_convert": sorted(not_convert),
    }  # fmt: skip


def is_routed_expert(key: str) -> bool:
    """An on-disk per-expert weight of the trunk (`mtp.*` and `model.visual.*` are not)."""
    return EXPERT_WEIGHT.match(key) is not None and not layout.is_extra(key)


def quantize_weights(src: str | Path, dst: str | Path, *, weights: str = "fp8", overwrite: bool = False) -> dict:
    """Write `src` to `dst` in the official FP8 layout (see the module doc).

    Returns:
        {"experts": number of expert matrices quantised, "tables": {table prefix: scale}} (copied FP8 tables are
        not listed).

    Raises:
        CheckpointError: an unknown scheme, `dst` equal to or holding `src`, `dst` not empty without `overwrite`,
            `src` already quantised, no expert in per-expert layout, or an expert not 2-D BF16/F16/F32 or with a
            dimension over 128 that is not a multiple of 128 (transformers derives the block from the grid).
    """
    if weights not in WEIGHT_SCHEMES:
        raise CheckpointError(f"--weights {weights!r}: expected one of {WEIGHT_SCHEMES}")
    src, dst = check_quantize_target(src, dst, overwrite)
    if quantization_config(load_config(src)) is not None:
        raise CheckpointError(f"{str(src)!r} is already quantised (its config.json has a {QUANT_KEY})")
    files, weight_map = checkpoint_files(src)
    headers = {f: data_offsets(f) for f in files}
    experts = _expert_keys(headers)
    tables = {pre: shards for pre, shards in _tables(headers).items() if not _is_fp8_table(headers, shards)}
    scales = {pre: float(torch.tensor(fp8_scale(_amax(headers, shards))).bfloat16()) for pre, shards in tables.items()}
    not_convert = _not_converted(headers, experts)
    qcfg = fp8_quantization_config(not_convert, bool(_tables(headers)))
    with writing(dst, overwrite) as tmp:
        _write(src, tmp, files, weight_map, headers, experts, tables, scales, qcfg)
    return {"experts": len(experts), "tables": scales}


def _is_fp8_table(headers: dict, shards: list[tuple[Path, str]]) -> bool:
    file, key = shards[0]
    return headers[file][1][key]["dtype"] == "F8_E4M3"


def _expert_keys(headers: dict) -> set[str]:
    """The routed expert weights to quantise, each checked (see `quantize_weights`)."""
    keys, problems = set(), []
    for _, header in headers.values():
        for key, info in header.items():
            if key.endswith(".mlp.experts.gate_up_proj") and not layout.is_extra(key):
                problems.append(f"{key}: experts stored whole; quantize reads the per-expert layout "
                                "(experts.{e}.gate_proj.weight, as save_pretrained writes it)")  # fmt: skip
            if key == "__metadata__" or not is_routed_expert(key):
                continue
            shape, dtype = info["shape"], info["dtype"]
            if dtype not in _SOURCE_DTYPES or len(shape) != 2:
                problems.append(f"cannot quantize {key}: it is {list(shape)} {dtype}, expected a matrix in "
                                f"{'/'.join(_SOURCE_DTYPES)}")  # fmt: skip
            elif any(n > BLOCK and n % BLOCK for n in shape):
                problems.append(f"cannot quantize {key} {list(shape)}: a dimension over {BLOCK} must be a multiple of "
                                f"{BLOCK} (transformers reads the block size off the scale grid)")  # fmt: skip
            else:
                keys.add(key)
    if problems:
        raise CheckpointError(f"cannot quantize to FP8 ({len(problems)} problem(s))", problems)
    if not keys:
        raise CheckpointError("no routed expert weights (...mlp.experts.{e}.gate_proj.weight) to quantize")
    return keys


def _not_converted(headers: dict, experts: set[str]) -> list[str]:
    """Every other matrix's module by full name (its key less `.weight`): the official `modules_to_not_convert`."""
    out = set()
    for _, header in headers.values():
        for key, info in header.items():
            if key == "__metadata__" or key in experts or len(info["shape"]) < 2:
                continue
            if info["dtype"] in _SOURCE_DTYPES and ".ngram_embedding." not in key:
                out.add(key.removesuffix(".weight"))
    return sorted(out)


def _write(src: Path, dst: Path, files, weight_map, headers, experts, tables, scales, qcfg) -> None:
    """Every file of `src` into the new directory `dst`, quantised (see the module doc)."""
    shard_scale = {key: scales[pre] for pre, shards in tables.items() for _, key in shards}
    scale_file = {pre: shards[0][0] for pre, shards in tables.items()}

    def entries_of(file: Path, base: int, key: str, info: dict) -> list[Entry]:
        return _entries(file, base, key, info, key in experts, shard_scale.get(key))

    def appended(file: Path) -> list[Entry]:
        pres = [pre for pre, f in scale_file.items() if f == file]
        values = [(pre, torch.tensor([scales[pre]], dtype=torch.bfloat16)) for pre in pres]
        return [Entry(scale_key(pre), "BF16", (1,), lambda v=v: [v]) for pre, v in values]

    write_checkpoint(src, dst, files, weight_map, headers, entries_of, qcfg, appended)


def write_checkpoint(src: Path, dst: Path, files, weight_map, headers, entries_of, qcfg: dict, appended=None) -> None:
    """The streamed copy every `quantize --weights` scheme shares: each file of `src` into `dst` (a new directory)
    with the same name, its tensors in stored order, each replaced by `entries_of(file, base, key, header entry)`
    (a list of `Entry`), then `appended(file)`; a new index when `src` has one; `config.json` with
    `quantization_config = qcfg`; every other file (tokenizer) copied."""
    new_map: dict[str, str] = {}
    total = 0
    for file in files:
        base, header = headers[file]
        keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        entries: list[Entry] = []
        for key in keys:
            entries += entries_of(file, base, key, header[key])
        entries += appended(file) if appended is not None else []
        total += write_safetensors(dst / file.name, entries, header.get("__metadata__"))
        new_map.update({e.key: file.name for e in entries})
    if weight_map is not None:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((src / "config.json").read_text())
    config[QUANT_KEY] = qcfg
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(other, dst / other.name)


def _entries(file: Path, base: int, key: str, info: dict, expert: bool, table_scale: float | None) -> list[Entry]:
    """One tensor's entries: copied byte for byte, an n-gram shard in FP8, or an expert's FP8 weight + scale."""
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    if table_scale is not None:
        rows = lambda: (quantize_fp8(r, table_scale) for r in row_chunks(file, base, info))  # noqa: E731
        return [Entry(key, "F8_E4M3", shape, rows)]
    if not expert:
        return [Entry(key, info["dtype"], shape, lambda: _raw_chunks(file, base + begin, base + end, PIECE_BYTES))]
    held: dict[str, torch.Tensor] = {}  # the scale, from the weight's quantisation to its own entry (written next)

    def weight():
        raw = next(_raw_chunks(file, base + begin, base + end, max(end - begin, 1)), bytearray())
        q, held["scale"] = quantize_blocks(torch.frombuffer(raw, dtype=TORCH_DTYPES[info["dtype"]]).view(shape))
        return [q]

    scale = Entry(key.removesuffix(".weight") + SCALE_SUFFIX, "BF16", scale_grid(*shape), lambda: [held.pop("scale")])
    return [Entry(key, "F8_E4M3", shape, weight), scale]
