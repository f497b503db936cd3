"""The official FP8 checkpoint: its `quantization_config`, and which routed experts it stores in block FP8.

`config.json` declares the scheme (top level, as transformers reads it; a text config's copy is accepted too):
```
"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                         "modules_to_convert": ["ple.ple_embedding.ngram_embedding"],
                         "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", ...]}
```
Routed experts are stored per expert, `...mlp.experts.{e}.{gate,up,down}_proj.weight` F8_E4M3 beside a
`...weight_scale_inv` with one multiplier per 128 x 128 block (`ops/fp8_blocks.py`); the n-gram tables are FP8
with one `weight_scale` per table (`checkpoint/ngram_tables.py`, loaded by the n-gram storage as before); every
other tensor is BF16. `modules_to_not_convert` names modules by their full on-disk name.

`fp8_expert_layers` reads the headers only, refuses (one `CheckpointError` listing every key at fault) what we
cannot load exactly: an FP8 tensor without its scale, a scale grid that does not match the weight in 128 x 128
blocks, a block size other than 128 x 128, E5M2, a `weight_scale_inv` on a module `modules_to_not_convert` lists,
FP8 outside the trunk's routed experts, FP8 without a declared scheme; and returns the experts modules to hold in
FP8 (`model/quant_experts_fp8.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flashnext.checkpoint import layout
from flashnext.checkpoint.files import TORCH_DTYPES, checkpoint_files, read_headers
from flashnext.config import ModelConfig
from flashnext.errors import CheckpointError
from flashnext.ops.fp8_blocks import BLOCK, scale_grid

QUANT_KEY = "quantization_config"
SCALE_SUFFIX = ".weight_scale_inv"
SCALE_DTYPES = ("BF16", "F32", "F16")
EXPERT_WEIGHT = re.compile(r"^(?P<pre>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def quantization_config(cfg: ModelConfig) -> dict | None:
    """The checkpoint's `quantization_config` object (top level, else the text config's), or None."""
    raw = cfg.top.get(QUANT_KEY) if cfg.composite else None
    return raw if raw is not None else cfg.text.extra.get(QUANT_KEY)


def parse_fp8_config(raw: dict) -> frozenset[str]:
    """Check a `quantization_config` we can load; returns its `modules_to_not_convert` (full names).

    Raises:
        CheckpointError: naming the field: not an object, a `quant_method` other than fp8, a block size other than
            [128, 128], per-tensor weight scales, or a `modules_to_not_convert` that is not a list of names.
    """
    where = f"config.json {QUANT_KEY}"
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be an object, got {raw!r}")
    if raw.get("quant_method") != "fp8":
        raise CheckpointError(f"{where}.quant_method={raw.get('quant_method')!r}: flashnext loads 'fp8' checkpoints")
    block = raw.get("weight_block_size")
    if block != [BLOCK, BLOCK]:
        raise CheckpointError(f"{where}.weight_block_size={block!r}: only [{BLOCK}, {BLOCK}] blocks are implemented")
    if raw.get("weight_per_tensor"):
        raise CheckpointError(f"{where}.weight_per_tensor=true: only {BLOCK}x{BLOCK} block scales are implemented")
    skip = raw.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise CheckpointError(f"{where}.modules_to_not_convert must be a list of module names, got {skip!r}")
    return frozenset(skip)


def fp8_expert_layers(path: str | Path, cfg: ModelConfig, style: str) -> dict[str, torch.dtype]:
    """{our experts module name (`model.layers.3.mlp.experts`): its scale dtype} of every layer whose routed experts
    the checkpoint stores in FP8; empty for a checkpoint without FP8 weights (headers only are read).

    Raises:
        CheckpointError: every FP8 problem of the checkpoint (see the module doc), each naming its key.
    """
    files, weight_map = checkpoint_files(path)
    headers, _, _ = read_headers(files, weight_map)  # unreadable files: the loader reports them
    raw = quantization_config(cfg)
    skip = parse_fp8_config(raw) if raw is not None else None
    problems: list[str] = []
    layers: dict[str, torch.dtype] = {}
    for key, (_, shape, dtype) in headers.items():
        if layout.NGRAM_SHARD.match(key) or key.endswith(".ngram_embedding.weight"):
            continue  # n-gram tables: their own FP8 layout and checks (checkpoint/ngram_tables.py)
        if key.endswith(SCALE_SUFFIX):
            problems += _scale_problems(key, shape, dtype, headers, skip)
        elif dtype == "F8_E5M2":
            problems.append(f"unsupported dtype: {key} is F8_E5M2; FP8 weights must be F8_E4M3 (float8_e4m3fn)")
        elif dtype == "F8_E4M3":
            problem, layer = _weight_problem(key, headers, skip, style)
            if problem:
                problems.append(problem)
            else:
                layers.setdefault(layer, TORCH_DTYPES[headers[key.removesuffix(".weight") + SCALE_SUFFIX][2]])
    if problems:
        raise CheckpointError(f"cannot load FP8 checkpoint {str(path)!r} ({len(problems)} problem(s))", problems)
    return layers


def _weight_problem(key: str, headers: dict, skip, style: str) -> tuple[str | None, str | None]:
    """(the problem of an F8_E4M3 weight `key`, or None; our experts module name it belongs to)."""
    if skip is None:
        return f"unexpected: {key} is F8_E4M3 but config.json declares no {QUANT_KEY} (quant_method fp8)", None
    m = EXPERT_WEIGHT.match(key)
    ours = layout.from_disk_name(m["pre"], style) if m else None
    if m is None or ours is None or layout.is_extra(key):
        return (f"unsupported: {key} is F8_E4M3; flashnext holds FP8 only for the trunk's routed experts "
                "(...mlp.experts.{e}.{gate,up,down}_proj.weight)"), None  # fmt: skip
    scale = key.removesuffix(".weight") + SCALE_SUFFIX
    if scale not in headers:
        return f"missing: {scale} (the F8_E4M3 weight {key} needs its block scales)", None
    return None, ours


def _scale_problems(key: str, shape, dtype: str, headers: dict, skip) -> list[str]:
    """Problems of a `...weight_scale_inv`: its module declared unconverted, no FP8 weight beside it, its grid."""
    module = key[: -len(SCALE_SUFFIX)]
    if skip is None:
        return [f"unexpected: {key} (a block scale) but config.json declares no {QUANT_KEY} (quant_method fp8)"]
    if module in skip:
        return [f"unexpected: {key}: {module} is listed in {QUANT_KEY}.modules_to_not_convert"]
    weight = headers.get(module + ".weight")
    if weight is None or weight[2] != "F8_E4M3":
        found = "no weight" if weight is None else f"a {weight[2]} weight"
        return [f"unexpected: {key} beside {found} ({module}.weight); block scales go with F8_E4M3 weights"]
    if dtype not in SCALE_DTYPES:
        return [f"wrong dtype: {key} is {dtype}, expected one of {', '.join(SCALE_DTYPES)}"]
    w_shape = weight[1]
    want = list(scale_grid(*w_shape)) if len(w_shape) == 2 else None
    if list(shape) != want:
        return [f"mis-shaped: {key} is {list(shape)}, expected {want}: the grid of {BLOCK}x{BLOCK} blocks over "
                f"{module}.weight {list(w_shape)}"]  # fmt: skip
    return []
