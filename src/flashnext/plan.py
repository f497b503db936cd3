"""A memory plan before loading: the bytes of every part of a model from its `config.json` alone.

`flashnext plan`, `serve` and `train` print it; `serve` and `train` refuse, before anything is allocated, a model
that cannot fit. Nothing here reads tensor data: the parameters come from a manifest of every tensor the builder
creates (`manifest.parameters`: names and shapes from the config, held equal to a built model's `named_parameters` by
`tests/test_plan.py`), the serving state from the formulas of each module's `state_spec` (held equal to
`serve.cache.StateCache.nbytes`), and a checkpoint's safetensors headers only say how its n-gram tables are stored.

Bytes per weight scheme (a 2-D linear weight `[N, K]`; a stacked expert weight `[E, N, K]` is E of them; `s` is
the scale dtype's size, that of the compute dtype, the dtype torch's weight-only kernels take their scales in):
- `fp32` 4 B/param, `bf16` 2 B/param;
- `fp8`: 1 B/param + one BF16 scale per 128 x 128 block (the official checkpoint's layout; routed experts only:
  gate and up are separate `[I, D]` matrices there, so each is blocked on its own);
- `int8`: 1 B/param + one scale per output channel (`N * s`);
- `int4`: 0.5 B/param + a scale and a zero per group of 128 inputs (`N * ceil(K / 128) * 2 * s`; an int4
  checkpoint's own group size when it has one); routed experts only (`int8` is the dense trunk's weight-only scheme).
An int8 / int4 checkpoint (`quantize --weights int8|int4`, `checkpoint/int_weights.py`) is planned as it stores
its parts (its `quantization_config`: trunk, experts, group size) unless `--weights` / `--trunk` / `--experts` say.
Norms, biases, convs, gates' vectors, embeddings and the vision tower stay in the compute dtype. `--weights int4`
means int4 experts over an int8 trunk; `--weights fp8` FP8 experts over a trunk in the compute dtype. The MTP
head's experts take the experts' scheme (in the official FP8 checkpoint they are FP8 too: its 114.86 GiB of
experts are the trunk's 120.8 B and the head's 2.5 B expert parameters at 1 byte each).

Serving adds the fused copies of same-input projections (`model/fused.py`: one concatenated weight per group,
built by `prepare_for_inference`), the per-slot state of `max_slots + 1` slots (the last one the scratch slot),
and a workspace estimate (the activations of one step of `max_batched_tokens` tokens and the sampled rows' fp32
logits; an estimate, not a measurement: compiled graphs and allocator slack come on top).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from flashnext.config import LINEAR, ModelConfig, TextConfig
from flashnext.errors import ConfigError
from flashnext.manifest import EXPERTS, MATRIX, TABLE, Param, gdn_dims, parameters
from flashnext.model.fused import FP32_COPY_MAX

SCHEMES = ("fp32", "bf16", "fp8", "int8", "int4")
TRUNK_SCHEMES = ("fp32", "bf16", "int8")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP8_BLOCK = 128
INT4_GROUP = 128
FP8_SCALE_BYTES = 2  # the official checkpoint's `weight_scale_inv` is BF16

# parts, in table order
PARTS = (
    "trunk", "routed experts", "lm_head", "embeddings", "n-gram tables", "MTP head", "vision tower",
    "fused serving copies", "GDN/conv state", "QSA K/V + index keys", "workspace (estimate)",
)  # fmt: skip


# ---- bytes of a weight under a scheme -----------------------------------------------------------------------


def matrix_bytes(n: int, k: int, scheme: str, scale_bytes: int, group: int = INT4_GROUP) -> int:
    """Bytes of one `[n, k]` linear weight stored under `scheme` (see the module docstring)."""
    if scheme in DTYPE_BYTES:
        return n * k * DTYPE_BYTES[scheme]
    if scheme == "fp8":
        return n * k + math.ceil(n / FP8_BLOCK) * math.ceil(k / FP8_BLOCK) * FP8_SCALE_BYTES
    if scheme == "int8":
        return n * k + n * scale_bytes
    if scheme == "int4":
        return math.ceil(n * k / 2) + n * math.ceil(k / group) * 2 * scale_bytes
    raise ConfigError(f"weight scheme {scheme!r}: expected one of {SCHEMES}")


def param_bytes(p: Param, scheme: str, compute: str, group: int = INT4_GROUP) -> int:
    """Bytes of parameter `p` when its kind's scheme is `scheme` (plain tensors: the compute dtype; int4 groups of
    `group` inputs)."""
    scale = DTYPE_BYTES[compute]
    if p.kind == MATRIX:
        return matrix_bytes(*p.shape, scheme, scale)
    if p.kind == EXPERTS:
        E, N, K = p.shape
        return E * p.splits * matrix_bytes(N // p.splits, K, scheme, scale, group)
    return p.numel * DTYPE_BYTES[compute]


# ---- options, and how the n-gram tables are held --------------------------------------------------------------


@dataclass
class PlanOptions:
    """What a plan is made for. `weights` None: as the checkpoint stores them (FP8 experts stay FP8), else the
    compute dtype; `experts` / `trunk` override the part's scheme. `max_slots` 0: no serving state (training)."""

    dtype: str = "bf16"
    weights: str | None = None
    experts: str | None = None
    trunk: str | None = None
    ngram_storage: str = "auto"
    ngram_resident_mb: float = 256.0
    max_slots: int = 16
    max_model_len: int = 2048
    max_batched_tokens: int = 512
    device: str = "cpu"
    mtp: bool = True  # count the MTP head (weights, fused copies, state) when the config declares one

    def schemes(self, stored_experts: str | None, stored_trunk: str | None = None) -> tuple[str, str]:
        """(trunk scheme, routed-experts scheme); `ConfigError` naming a scheme a part cannot take."""
        weights = self.weights
        for flag, value in (("--weights", weights), ("--experts", self.experts), ("--trunk", self.trunk)):
            if value is not None and value not in SCHEMES:
                raise ConfigError(f"{flag} {value!r}: expected one of {SCHEMES}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype {self.dtype!r}: expected one of {tuple(DTYPE_BYTES)}")
        if weights is None:
            trunk, experts = stored_trunk or self.dtype, stored_experts or self.dtype
        elif weights in DTYPE_BYTES:
            trunk = experts = weights
        else:  # fp8: the official layout (experts only); int4: experts, over an int8 trunk
            trunk, experts = {"fp8": self.dtype, "int8": "int8", "int4": "int8"}[weights], weights
        trunk, experts = self.trunk or trunk, self.experts or experts
        if trunk not in TRUNK_SCHEMES:
            raise ConfigError(
                f"--trunk {trunk}: the dense trunk takes {TRUNK_SCHEMES} ({trunk} is for the routed experts only)"
            )
        return trunk, experts


@dataclass
class StoredAs:
    """What a checkpoint's files say about its storage (from `config.json` and safetensors headers only)."""

    table_dtype: str | None = None  # "fp8", "bf16", "fp32" (None: no checkpoint files or no table in them)
    experts: str | None = None  # "fp8" for the official FP8 checkpoint, "int8" / "int4" for an int one, else None
    trunk: str | None = None  # "int8" for an int checkpoint with an int8 trunk, else None
    int4_group: int = INT4_GROUP  # an int4 checkpoint's group size
    headers_read: bool = False


_HEADER_DTYPES = {"F8_E4M3": "fp8", "BF16": "bf16", "F32": "fp32", "F16": "bf16"}


def stored_as(path: str | Path | None, raw_config: dict) -> StoredAs:
    """How a checkpoint stores its n-gram tables and experts: its safetensors headers when present, else its
    `quantization_config` (`modules_to_convert` naming the n-gram table, `quant_method: fp8`) and `dtype`."""
    quant = raw_config.get("quantization_config") or {}
    fp8 = quant.get("quant_method") == "fp8"
    named = raw_config.get("dtype", raw_config.get("torch_dtype"))
    out = StoredAs(experts="fp8" if fp8 else None)
    if quant.get("quant_method") == "flashnext_int":  # `checkpoint/int_weights.py`: the scheme per part
        out.experts = quant.get("experts") if quant.get("experts") in ("int8", "int4") else None
        out.trunk = "int8" if quant.get("trunk") == "int8" else None
        out.int4_group = quant.get("group_size", INT4_GROUP)
    if fp8 and any("ngram_embedding" in m for m in quant.get("modules_to_convert", [])):
        out.table_dtype = "fp8"
    elif named in ("bfloat16", "float32"):
        out.table_dtype = {"bfloat16": "bf16", "float32": "fp32"}[named]
    if path is None or not Path(path).is_dir():
        return out
    from flashnext.checkpoint.files import checkpoint_files, read_headers

    try:
        files, weight_map = checkpoint_files(path)
    except Exception:  # no weights here (a bare config): the config alone decides
        return out
    headers, _, _ = read_headers(files, weight_map)
    out.headers_read = bool(headers)
    tables = [d for k, (_, _, d) in headers.items() if re.search(r"ngram_embedding(\.shard_\d+)?\.weight$", k)]
    if tables:
        out.table_dtype = _HEADER_DTYPES.get(tables[0], out.table_dtype)
    if any(k.endswith("_proj.weight_scale_inv") and ".experts." in k for k in headers):
        out.experts = "fp8"
    return out


def table_bytes(p: Param, storage: str, stored: StoredAs, opts: PlanOptions) -> tuple[int, str]:
    """(bytes, where: "device" or "host") of one n-gram table held as `storage` (`ngram/storage.py`)."""
    rows, width = p.shape
    dense = rows * width * DTYPE_BYTES[opts.dtype]
    kept = stored.table_dtype or opts.dtype
    if storage == "dense" or (storage == "auto" and kept != "fp8"):
        return dense, "device"
    if storage in ("auto", "stored"):
        if kept == "fp8":
            return rows * width + FP8_SCALE_BYTES, "device"
        return rows * width * DTYPE_BYTES[kept], "device"
    if storage == "nf4":
        return rows * (width // 2 + 2), "device"
    if storage == "mmap":  # rows read from the files; a bounded row cache in host memory
        stored_bytes = rows * width * (1 if kept == "fp8" else DTYPE_BYTES[kept])
        return min(int(opts.ngram_resident_mb * 2**20), stored_bytes), "host"
    raise ConfigError(f"--ngram-storage {storage!r}: expected auto, dense, stored, mmap or nf4")


# ---- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    part: str
    bytes: int
    where: str = "device"  # "device": on --device (RAM for cpu); "host": host RAM whatever the device
    note: str = ""


@dataclass
class Plan:
    rows: list[Row] = field(default_factory=list)
    device: str = "cpu"
    header: str = ""

    @property
    def total(self) -> int:
        return sum(r.bytes for r in self.rows)

    def on(self, where: str) -> int:
        """Bytes that go to host RAM (`host`) or to the GPU (`gpu`; 0 on a CPU device)."""
        gpu = not self.device.startswith("cpu")
        if where == "gpu":
            return sum(r.bytes for r in self.rows if r.where == "device") if gpu else 0
        return sum(r.bytes for r in self.rows if r.where == "host" or not gpu)


def weight_rows(cfg: ModelConfig, opts: PlanOptions, stored: StoredAs) -> list[Row]:
    """The parameter parts of `cfg` under `opts`: bytes per part, schemes in the notes."""
    trunk, experts = opts.schemes(stored.experts, stored.trunk)
    sums: dict[str, int] = {}
    where: dict[str, str] = {}
    for p in parameters(cfg, opts.mtp):
        if p.kind == TABLE:
            b, where[p.part] = table_bytes(p, opts.ngram_storage, stored, opts)
        elif p.kind == EXPERTS:
            b = param_bytes(p, experts, opts.dtype, stored.int4_group)
        else:
            b = param_bytes(p, trunk, opts.dtype)
        sums[p.part] = sums.get(p.part, 0) + b
    kept = stored.table_dtype or opts.dtype
    notes = {
        "trunk": f"{trunk} linears, {opts.dtype} norms/convs",
        "routed experts": experts + (" + bf16 128x128 block scales" if experts == "fp8" else ""),
        "lm_head": trunk,
        "embeddings": opts.dtype,
        "n-gram tables": f"--ngram-storage {opts.ngram_storage} (stored {kept})"
        + (f", {opts.ngram_resident_mb:g} MiB row cache per table" if opts.ngram_storage == "mmap" else ""),
        "MTP head": f"{trunk} linears, {experts} experts",
        "vision tower": opts.dtype,
    }
    return [Row(part, sums[part], where.get(part, "device"), notes[part]) for part in PARTS if part in sums]


def fused_copy_bytes(cfg: ModelConfig, opts: PlanOptions, trunk: str) -> int:
    """Bytes of the concatenated weights `model/fused.py` builds for serving (one per `Group` of same-input
    projections: GDN and QSA in-projections, router + shared expert gate/up + its gate, PLE key/value, each
    hyper-connection's down + inject), at the trunk's scheme."""
    members = re.compile(
        r"(in_proj_(qkv|z|b|a)|[qkv]_proj|index_qk_proj|mlp\.gate|shared_expert\.(gate|up)_proj|shared_expert_gate|"
        r"key_proj|value_proj|input_mix_weight_down|block_inject_weight)\.weight$"
    )
    every = parameters(cfg, opts.mtp)
    fused = [p for p in every if p.kind == MATRIX and not p.name.startswith("model.visual.")]
    total = sum(param_bytes(p, trunk, opts.dtype) for p in fused if members.search(p.name))
    qsa_in = re.compile(r"self_attn\.([qkv]_proj|indexer\.index_qk_proj)\.weight$")
    if cfg.text.attention_bias:  # the QSA group's bias: q/k/v biases and zeros for the indexer's rows
        total += sum(p.shape[0] for p in fused if qsa_in.search(p.name)) * DTYPE_BYTES[opts.dtype]
    if opts.device.startswith("cpu") and trunk in ("bf16", "fp16"):
        total += _fp32_copy_bytes(cfg, every, members, qsa_in, trunk)
    return total


def _fp32_copy_bytes(cfg: ModelConfig, every: list[Param], members: re.Pattern, qsa_in: re.Pattern, dtype: str) -> int:
    """`model/fused.py`'s copies for small low-precision CPU weights (<= `FP32_COPY_MAX` elements): an fp32 copy of
    each such group's fused weight (+ bias), and for an `nn.Linear` in no group its own one-member group (a
    `dtype` copy and an fp32 one, + bias)."""
    biases = {p.name: p.numel for p in every if p.name.endswith(".bias")}
    owners: dict[str, list[Param]] = {}
    for p in every:
        if p.kind == MATRIX and not p.name.startswith("model.visual.") and (m := members.search(p.name)):
            owner = re.sub(r"(indexer\.|shared_expert\.)$", "", p.name[: m.start()])
            owners.setdefault(owner, []).append(p)
    total = 0
    for group in owners.values():
        numel = sum(p.numel for p in group)
        rows = sum(p.shape[0] for p in group)
        has_bias = any(p.name.removesuffix(".weight") + ".bias" in biases for p in group) or (
            cfg.text.attention_bias and any(qsa_in.search(p.name) for p in group)
        )
        if numel <= FP32_COPY_MAX:
            total += 4 * (numel + (rows if has_bias else 0))
    for p in every:
        linear = p.kind == MATRIX or (p.name.startswith("model.visual.") and len(p.shape) == 2)  # vision: plain
        if linear and SINGLE_LINEARS.search(p.name) and p.numel <= FP32_COPY_MAX:
            bias = biases.get(p.name.removesuffix(".weight") + ".bias", 0)
            total += (DTYPE_BYTES[dtype] + 4) * (p.numel + bias)
    return total


# `nn.Linear`s in no `Group` (`model/fused.py` gives a small low-precision one a group of its own at `prepare`)
SINGLE_LINEARS = re.compile(
    r"(lm_head|input_mix_weight_up|linear_attn\.out_proj|shared_expert\.down_proj|self_attn\.o_proj|fc_embedding|"
    r"fc_hidden|visual\..*(attn\.proj|attn\.qkv|linear_fc\d))\.weight$"
)


def state_bytes(
    text: TextConfig, max_slots: int, max_model_len: int, dtype: str, with_mtp: bool = True
) -> tuple[int, int]:
    """(GDN conv + recurrent and PLE state, QSA K/V + indexer keys) bytes of a `StateCache` of `max_slots` slots
    (+1 scratch) for sequences up to `max_model_len`, as each module's `state_spec` declares them (the MTP head's
    layers too when `with_mtp`)."""
    S, b = max_slots + 1, DTYPE_BYTES[dtype]
    n_linear = sum(t == LINEAR for t in text.layer_types)
    n_qsa = len(text.layer_types) - n_linear + (text.mtp_layers if with_mtp else 0)
    Hk, Hv, Dk, Dv = gdn_dims(text)
    conv_dim = 2 * Hk * Dk + Hv * Dv
    gdn = (text.linear_conv_kernel_dim - 1) * conv_dim * b + Hv * Dk * Dv * 4
    ple_conv_rows = (text.ple_conv_kernel_size - 1) * text.ngram_size
    ple = (text.ngram_size - 1) * 8 + ple_conv_rows * text.hc_count * text.hidden_size * b  # int64 context + conv
    per_slot = n_linear * gdn + len(text.ple_layer_ids) * ple
    qsa = 0
    if n_qsa:
        c, Di = text.indexer_compress_ratio, text.indexer_head_dim
        rows = (max_model_len // c + 1) * c
        qsa = n_qsa * (2 * rows * text.num_key_value_heads * text.head_dim + rows * Di + rows // c * Di) * b
    return S * per_slot, S * qsa


def workspace_bytes(text: TextConfig, opts: PlanOptions) -> int:
    """An estimate of one serving step's live activations: `max_batched_tokens` rows of the residual streams
    (input, mixed, output), the widest projection output, the routed experts' gate/up rows, plus the sampled rows'
    fp32 logits. A lower bound of the workspace, not a measurement."""
    T, D, b = opts.max_batched_tokens, text.hidden_size, DTYPE_BYTES[opts.dtype]
    Hk, Hv, Dk, Dv = gdn_dims(text)
    widest = max(
        2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv,
        (2 * text.num_attention_heads + 2 * text.num_key_value_heads) * text.head_dim,
        2 * text.shared_expert_intermediate_size,
    )
    per_token = 3 * text.hc_count * D + widest + text.num_experts_per_tok * 2 * text.moe_intermediate_size
    return T * per_token * b + opts.max_slots * text.vocab_size * 4


def make_plan(cfg: ModelConfig, opts: PlanOptions, stored: StoredAs | None = None) -> Plan:
    """The serving plan of `cfg` under `opts` (no serving rows when `opts.max_slots` is 0)."""
    stored = stored or StoredAs()
    trunk, _ = opts.schemes(stored.experts, stored.trunk)
    plan = Plan(weight_rows(cfg, opts, stored), device=opts.device)
    if opts.max_slots:
        fused = fused_copy_bytes(cfg, opts, trunk)
        plan.rows.append(Row("fused serving copies", fused, note=f"{trunk}, model/fused.py"))
        gdn, qsa = state_bytes(cfg.text, opts.max_slots, opts.max_model_len, opts.dtype, opts.mtp)
        slots = f"{opts.max_slots}+1 slots"
        plan.rows.append(Row("GDN/conv state", gdn, note=f"{slots}, fp32 recurrent"))
        plan.rows.append(Row("QSA K/V + index keys", qsa, note=f"{slots} x {opts.max_model_len} tokens, {opts.dtype}"))
        plan.rows.append(
            Row("workspace (estimate)", workspace_bytes(cfg.text, opts), note=f"{opts.max_batched_tokens}-token step")
        )
    return plan


# ---- this machine, and the verdict ----------------------------------------------------------------------------


@dataclass
class Capacity:
    """Memory this machine offers now (bytes; None where unknown)."""

    ram_available: int | None
    ram_total: int | None
    gpu_free: int | None = None
    gpu_total: int | None = None


def machine_capacity(device: str = "cpu") -> Capacity:
    """Available and total RAM (psutil, else /proc/meminfo) and, for a CUDA device, the GPU's free and total."""
    avail = total = None
    try:
        import psutil

        vm = psutil.virtual_memory()
        avail, total = int(vm.available), int(vm.total)
    except ImportError:
        try:
            info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
            avail = int(info["MemAvailable"].split()[0]) * 1024
            total = int(info["MemTotal"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            pass
    cap = Capacity(avail, total)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            index = torch.device(device).index or 0
            cap.gpu_free, cap.gpu_total = (int(x) for x in torch.cuda.mem_get_info(index))
    return cap


def budget_capacity(budget: int) -> Capacity:
    """A hypothetical machine offering `budget` bytes (RAM for a CPU plan, GPU memory for a CUDA one)."""
    return Capacity(budget, budget, budget, budget)


def shortfall(plan: Plan, cap: Capacity) -> str | None:
    """None when the plan fits `cap`, else why not (one phrase)."""
    gpu = not plan.device.startswith("cpu")
    if gpu and cap.gpu_free is not None and plan.on("gpu") > cap.gpu_free:
        return f"needs {gib(plan.on('gpu'))} on {plan.device}, {gib(cap.gpu_free)} free"
    if cap.ram_available is not None and plan.on("host") > cap.ram_available:
        return f"needs {gib(plan.on('host'))} of RAM, {gib(cap.ram_available)} available"
    return None


def gib(n: int | float) -> str:
    """Bytes in a readable unit: GiB from 1 GiB up, else MiB, else KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def format_plan(plan: Plan, cap: Capacity, title: str = "") -> str:
    """The plan as a table: part, bytes, GiB, note; the total; the verdict against `cap`."""
    lines = [title] if title else []
    width = max(len(r.part) for r in plan.rows) if plan.rows else 10
    for r in plan.rows:
        where = " [host RAM]" if r.where == "host" and not plan.device.startswith("cpu") else ""
        lines.append(f"  {r.part:<{width}} {r.bytes:>18,d} B {gib(r.bytes):>12}  {r.note}{where}")
    lines.append(f"  {'total':<{width}} {plan.total:>18,d} B {gib(plan.total):>12}")
    ram = "unknown" if cap.ram_available is None else f"{gib(cap.ram_available)} available of {gib(cap.ram_total)}"
    lines.append(f"  RAM: {ram}; on host: {gib(plan.on('host'))}")
    if not plan.device.startswith("cpu"):
        free = "unknown" if cap.gpu_free is None else f"{gib(cap.gpu_free)} free of {gib(cap.gpu_total)}"
        lines.append(f"  GPU {plan.device}: {free}; on GPU: {gib(plan.on('gpu'))}")
    why = shortfall(plan, cap)
    unknown = not plan.device.startswith("cpu") and cap.gpu_free is None
    verdict = "unknown (no CUDA here to ask the GPU; try --budget)" if unknown else "yes"
    lines.append(f"  fits: {verdict}" if why is None else f"  fits: NO ({why})")
    return "\n".join(lines)


def parse_bytes(text: str) -> int:
    """'141GB', '128 GiB', '64g', '5e10' -> bytes (GB = 1e9, GiB = 2**30; a bare number is GB)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    units = {"": 1e9, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
    try:
        return int(float(m.group(1)) * units[m.group(2).lower()])
    except (AttributeError, KeyError, ValueError):
        raise ConfigError(f"a memory size like 141GB or 128GiB, got {text!r}") from None
