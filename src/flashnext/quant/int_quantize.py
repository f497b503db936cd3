"""`flashnext quantize --weights int8|int4` (or per part `--trunk int8 --experts int4 --group-size 64`): a checkpoint
whose quantized modules are stored as int8 / int4 codes + scales (the format: `checkpoint/int_weights.py`).

The modules are those `quant.apply.quantize_model` replaces for the scheme (`int_checkpoint.int_modules` on the
config's model built on `meta`: names and shapes only). Each of their float weights (a linear's `.weight`; a routed
expert's `.{e}.{gate,up,down}_proj.weight`) is read, quantised by the in-memory functions (`quantize_int8`,
`quantize_int4`, scales in the CPU kernels' dtype: BF16, F16 for an F16 source) and written as `.qweight` +
`.weight_scale` (+ `.weight_zero`) before the next is read: peak memory is one tensor and its output. Every other
tensor is copied byte for byte, in the same files (`quantize_weights.write_checkpoint`); OUT must be absent or empty
unless `overwrite`, which replaces it whole (`checkpoint/target.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashnext.checkpoint.files import TORCH_DTYPES, checkpoint_files, data_offsets
from flashnext.checkpoint.fp8_weights import quantization_config
from flashnext.checkpoint.int_weights import (
    QUANT_KEY,
    disk_module,
    expert_matrices,
    int_quantization_config,
    pack_nibbles,
)
from flashnext.checkpoint.load import ties_embeddings
from flashnext.checkpoint.quantize import PIECE_BYTES, _raw_chunks, check_quantize_target
from flashnext.checkpoint.quantize_weights import write_checkpoint
from flashnext.checkpoint.stream_write import Entry
from flashnext.checkpoint.target import writing
from flashnext.config import load_config
from flashnext.errors import CheckpointError
from flashnext.model.multimodal import on_meta
from flashnext.quant.int_checkpoint import int_modules
from flashnext.quant.int_experts import check_group, quantize_int4
from flashnext.quant.int_linear import compute_dtype, quantize_int8

_SOURCE_DTYPES = ("BF16", "F16", "F32")


def quantize_int(src: str | Path, dst: str | Path, scheme, *, overwrite: bool = False) -> dict:
    """Write `src` to `dst` with the modules `scheme` (a `quant.apply.QuantScheme`) names in int8 / int4.

    Returns:
        {"matrices": number of matrices quantised, "modules": {"int8": [...], "int4": [...]} (on-disk names)}.

    Raises:
        CheckpointError: nothing to quantize, `dst` equal to or holding `src`, `dst` not empty without `overwrite`,
            `src` already quantised, experts stored whole, a module's weight missing or not a BF16/F16/F32 matrix of
            the config's shape.
        ConfigError: an int4 group that does not fit the experts.
    """
    if not scheme.enabled:
        raise CheckpointError("quantize: nothing to quantize (--weights int8|int4, or --trunk int8 / --experts ...)")
    src, dst = check_quantize_target(src, dst, overwrite)
    cfg = load_config(src)
    if quantization_config(cfg) is not None:
        raise CheckpointError(f"{str(src)!r} is already quantised (its config.json has a {QUANT_KEY})")
    files, weight_map = checkpoint_files(src)
    headers = {f: data_offsets(f) for f in files}
    infos = {k: i for _, h in headers.values() for k, i in h.items() if k != "__metadata__"}
    style = "multimodal" if cfg.vision_config is not None else "composite" if cfg.composite else "text"
    model = on_meta(cfg, torch.float32)
    if model.mtp is not None and not any(k.startswith("mtp.") for k in infos):
        model.mtp = None  # as `from_pretrained` loads it: no head to quantize
    targets, tied, modules, problems = _plan(model, cfg, scheme, style, infos)
    if problems:
        raise CheckpointError(f"cannot quantize {str(src)!r} to {scheme} ({len(problems)} problem(s))", problems)
    qcfg = int_quantization_config(scheme.trunk, scheme.experts, scheme.group, modules)

    def entries_of(file: Path, base: int, key: str, info: dict) -> list[Entry]:
        head = _entries(file, base, key, info, tied[key], scheme.group, "lm_head.weight") if key in tied else []
        return _entries(file, base, key, info, targets.get(key), scheme.group) + head

    with writing(dst, overwrite) as tmp:
        write_checkpoint(src, tmp, files, weight_map, headers, entries_of, qcfg)
    return {"matrices": len(targets), "modules": {k: v for k, v in modules.items() if v}}


def _plan(model, cfg, scheme, style: str, infos: dict):
    """What to quantize: (float weight key -> scheme, a tied embedding's key -> lm_head's scheme, the on-disk
    module names per scheme, the problems found)."""
    targets: dict[str, str] = {}  # float weight key -> scheme
    tied: dict[str, str] = {}  # the embedding's key -> lm_head's scheme (tied: quantized as lm_head too)
    modules: dict[str, list[str]] = {"int8": [], "int4": []}
    problems: list[str] = []
    for name, kind in int_modules(model, scheme.trunk, scheme.experts).items():
        disk, mod = disk_module(name, kind, style), model.get_submodule(name)
        which = scheme.experts if kind == "experts" else scheme.trunk
        if kind == "experts":
            E, two_i, D = mod.gate_up_proj.shape
            if which == "int4":
                check_group(scheme.group, D, two_i // 2)
            if disk + ".gate_up_proj" in infos:
                problems.append(f"{disk}.gate_up_proj: experts stored whole; quantize reads the per-expert layout "
                                "(experts.{e}.gate_proj.weight, as save_pretrained writes it)")  # fmt: skip
                continue
            mats = expert_matrices(disk, E, D, two_i // 2)
        else:
            mats = [(disk, *mod.weight.shape)]
        for m, N, K in mats:
            info = infos.get(m + ".weight")
            if info is None and m == "lm_head" and (embed := _tied_embedding(cfg, infos)):
                tied[embed] = which  # a tied checkpoint stores no lm_head: its codes come from the embedding's bytes
                modules[which].append(disk)
                continue
            if info is None:
                problems.append(f"missing: {m}.weight [{N}, {K}] (the {which} scheme quantizes {disk})")
            elif info["dtype"] not in _SOURCE_DTYPES or tuple(info["shape"]) != (N, K):
                problems.append(f"cannot quantize {m}.weight: it is {info['shape']} {info['dtype']}, expected "
                                f"[{N}, {K}] in {'/'.join(_SOURCE_DTYPES)}")  # fmt: skip
            else:
                targets[m + ".weight"] = which
        modules[which].append(disk)
    return targets, tied, modules, problems


def _tied_embedding(cfg, infos: dict) -> str | None:
    """The token embedding's key when the config ties `lm_head` to it (which `from_pretrained` then copies)."""
    keys = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    return next((k for k in keys if k in infos), None) if ties_embeddings(cfg) else None


def _entries(file: Path, base: int, key: str, info: dict, which: str | None, group: int, out: str | None = None):
    """A tensor copied byte for byte, or a float weight's codes + scales (+ zeros) under `out` (default `key`),
    quantised when its first entry is written (the others are held until theirs, written right after)."""
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    if which is None:
        return [Entry(key, info["dtype"], shape, lambda: _raw_chunks(file, base + begin, base + end, PIECE_BYTES))]
    N, K = shape
    cdtype = compute_dtype(TORCH_DTYPES[info["dtype"]])
    sdtype = "F16" if cdtype == torch.float16 else "BF16"
    held: dict[str, torch.Tensor] = {}
    pre = (out or key).removesuffix(".weight")

    def codes():
        raw = next(_raw_chunks(file, base + begin, base + end, max(end - begin, 1)), bytearray())
        w = torch.frombuffer(raw, dtype=TORCH_DTYPES[info["dtype"]]).view(shape)
        if which == "int8":
            q, held["scale"] = quantize_int8(w, cdtype)
            return [q]
        q, sz = quantize_int4(w, group, cdtype)  # sz [K/g, N, 2] -> scale, zero [N, K/g]
        held["scale"], held["zero"] = sz[..., 0].t().contiguous(), sz[..., 1].t().contiguous()
        return [pack_nibbles(q)]

    if which == "int8":
        return [Entry(pre + ".qweight", "I8", (N, K), codes),
                Entry(pre + ".weight_scale", sdtype, (N,), lambda: [held.pop("scale")])]  # fmt: skip
    return [Entry(pre + ".qweight", "U8", (N, K // 2), codes),
            Entry(pre + ".weight_scale", sdtype, (N, K // group), lambda: [held.pop("scale")]),
            Entry(pre + ".weight_zero", sdtype, (N, K // group), lambda: [held.pop("zero")])]  # fmt: skip
