"""Our model -> a GGUF file for llama.cpp's `qwen4exp` architecture (for `vs_llamacpp.py`), and a GGUF reader.

The file format (GGUF v3, little-endian): magic `GGUF`, version 3, tensor count, key/value count; the key/value
pairs (typed values, arrays of one element type); per tensor its name, dims (innermost first: a contiguous torch
tensor [a, b, c] is ggml [c, b, a] with the same bytes), ggml type and data offset; then the data, every tensor at a
multiple of `ALIGNMENT` bytes from the data section's start, which itself starts at such a multiple.

The tensor names, shapes, metadata keys and weight transforms follow llama.cpp's qwen4exp loader and converter as
published upstream (facts about their format; written here from scratch):
- norms scaling by (1 + w) are stored as 1 + w (llama.cpp multiplies by the stored gamma); the gated GDN norm,
  which scales by w, as is;
- GDN: `A_log` -> `ssm_a = -exp(A_log)`, `dt_bias` -> `ssm_dt.bias`, the depthwise convs squeezed to [C, K]; with
  fewer key than value heads, the value heads of qkv, z, a, b, A, dt, the conv's value channels and out_proj's
  input columns are reordered from grouped-by-key-head to tiled order (llama.cpp broadcasts by repeating);
- the indexer's joint q/k projection is split into `indexer.q_proj` and `indexer.k_proj`;
- the fused expert gate/up projection is split into `ffn_gate_exps` and `ffn_up_exps`;
- the PLE hash constants go into metadata; its table is `per_layer_token_embd`.
llama.cpp supports one PLE layer, the sigmoid output gate and GDN key dim == value dim: `check_supported` refuses
anything else. Whether a llama.cpp build accepts the file is checked where it matters: `vs_llamacpp.py` compares its
greedy tokens with ours before it times anything.

Matrices are written in the requested dtype (F32 or BF16); 1-D tensors, norms, convs, the router and the GDN
decay parameters stay F32, as llama.cpp's converter keeps them.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

ALIGNMENT = 32
GGUF_MAGIC = b"GGUF"
# value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q",
           F64: "<d"}  # fmt: skip
# ggml tensor types
GGML_F32, GGML_BF16 = 0, 30
_GGML_OF = {torch.float32: GGML_F32, torch.bfloat16: GGML_BF16}
FILE_TYPE = {torch.float32: 0, torch.bfloat16: 32}  # general.file_type: all F32 / mostly BF16


class Typed:
    """A metadata value with an explicit GGUF type (`kind`; arrays: `ARRAY` with `elem`)."""

    def __init__(self, kind: int, value, elem: int | None = None):
        self.kind, self.value, self.elem = kind, value, elem


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(kind: int, value, elem: int | None) -> bytes:
    if kind == STRING:
        return _str(value)
    if kind == ARRAY:
        out = struct.pack("<IQ", elem, len(value))
        return out + b"".join(_value(elem, v, None) for v in value)
    return struct.pack(_SCALAR[kind], value)


def _typed(value) -> Typed:
    """Plain Python values: bool -> BOOL, int -> U32 (I64 when negative or wider), float -> F32, str -> STRING."""
    if isinstance(value, Typed):
        return value
    if isinstance(value, bool):
        return Typed(BOOL, value)
    if isinstance(value, int):
        return Typed(U32 if 0 <= value < 2**32 else I64, value)
    if isinstance(value, float):
        return Typed(F32, value)
    if isinstance(value, str):
        return Typed(STRING, value)
    raise TypeError(f"no GGUF type for {type(value).__name__}: wrap it in Typed")


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Write a GGUF v3 file: `metadata` {key: value or Typed}, `tensors` [(name, contiguous F32/BF16 tensor)]."""
    infos, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        dims = list(reversed(t.shape)) or [1]
        infos.append(_str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", _GGML_OF[t.dtype], offset))  # fmt: skip
        offset += -(-nbytes // ALIGNMENT) * ALIGNMENT
    kv = []
    for key, value in metadata.items():
        v = _typed(value)
        kv.append(_str(key) + struct.pack("<I", v.kind) + _value(v.kind, v.value, v.elem))
    head = GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    with open(path, "wb") as f:
        f.write(head + b"\0" * (-len(head) % ALIGNMENT))
        for _, t in tensors:
            data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(data + b"\0" * (-len(data) % ALIGNMENT))


def read_gguf(path: Path) -> tuple[dict, dict[str, tuple[list[int], int, bytes]]]:
    """(metadata {key: value}, tensors {name: (dims innermost first, ggml type, data bytes)})."""
    buf = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        out = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return out if len(out) > 1 else out[0]

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        pos += n
        return buf[pos - n : pos].decode("utf-8")

    def value(kind: int):
        if kind == STRING:
            return string()
        if kind == ARRAY:
            elem, n = take("<IQ")
            return [value(elem) for _ in range(n)]
        return take(_SCALAR[kind])

    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("<IQQ")
    if version != 3:
        raise ValueError(f"{path}: GGUF version {version}, expected 3")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        n_dims = take("<I")
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos))
        pos += 8 * n_dims
        kind, offset = take("<IQ")
        infos.append((name, dims, kind, offset))
    start = pos + (-pos % ALIGNMENT)
    tensors = {}
    for name, dims, kind, offset in infos:
        size = int(np.prod(dims)) * (4 if kind == GGML_F32 else 2)
        tensors[name] = (dims, kind, buf[start + offset : start + offset + size])
    return meta, tensors


# ---- our model -> llama.cpp's qwen4exp -------------------------------------------------------------------------
HC = {"attn_hyper_connection": "hc_attn", "mlp_hyper_connection": "hc_ffn"}
HC_PARTS = {"hc_norm.weight": "norm", "input_mix_weight_down.weight": "down", "input_mix_weight_up.weight": "up",
            "block_inject_weight.weight": "inject"}  # fmt: skip
RENAME = {  # our name within a layer -> llama.cpp's (after `blk.{i}.`), no transform
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "ple.key_proj.weight": "ple_key.weight",
    "ple.value_proj.weight": "ple_value.weight",
}
PLUS_ONE = {  # (1 + w) norms
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
    "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
    "ple.norm_key.weight": "ple_norm_key.weight",
    "ple.norm_query.weight": "ple_norm_query.weight",
    "ple.norm_conv.weight": "ple_norm_conv.weight",
}
KEEP_F32 = ("norm", "ssm_a", "ssm_dt", "conv1d", "ffn_gate_inp", "hc_attn_inject", "hc_ffn_inject")


def check_supported(cfg) -> None:
    """Raise ValueError for what llama.cpp's qwen4exp does not implement (see the module doc)."""
    problems = []
    if len(cfg.ple_layer_ids) > 1:
        problems.append(f"{len(cfg.ple_layer_ids)} PLE layers (llama.cpp supports one)")
    if cfg.gate_act != "sigmoid":
        problems.append(f"output gate {cfg.gate_act!r} (llama.cpp applies sigmoid)")
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        problems.append("GDN key head dim != value head dim")
    if cfg.ple_layer_ids and cfg.ple_embed_dim != cfg.hidden_size:
        problems.append(f"ple_embed_dim {cfg.ple_embed_dim} != hidden_size (llama.cpp's PLE projections assume it)")
    qsa = [i for i, t in enumerate(cfg.layer_types) if t != "linear_attention"]
    interval = qsa[0] + 1 if qsa else 0
    if not qsa or qsa != list(range(interval - 1, cfg.num_hidden_layers, interval)):
        problems.append(f"QSA layers {qsa} are not every k-th layer (llama.cpp derives them from an interval)")
    if problems:
        raise ValueError("llama.cpp's qwen4exp cannot run this config: " + "; ".join(problems))


def _tiled(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head: int) -> torch.Tensor:
    """Value heads along `dim` from grouped-by-key-head [K, per_k, head] to tiled [per_k, K, head] order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k_heads, per_k, head, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _gdn(name: str, t: torch.Tensor, cfg) -> tuple[str, torch.Tensor]:
    """A GDN parameter (`name` after `linear_attn.`) in llama.cpp's name, layout and value transform."""
    kh, vh, kd, vd = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)  # fmt: skip
    per_k, qk = vh // kh, 2 * kh * kd

    def tile(x, dim, head):
        return _tiled(x, dim, kh, per_k, head) if per_k > 1 else x

    if name == "in_proj_qkv.weight":
        return "attn_qkv.weight", torch.cat([t[:qk], tile(t[qk:], 0, vd)])
    if name == "in_proj_z.weight":
        return "attn_gate.weight", tile(t, 0, vd)
    if name in ("in_proj_b.weight", "in_proj_a.weight"):
        return ("ssm_beta.weight" if "_b" in name else "ssm_alpha.weight"), tile(t, 0, 1)
    if name == "A_log":
        return "ssm_a", tile(-t.float().exp()[:, None], 0, 1)[:, 0]
    if name == "dt_bias":
        return "ssm_dt.bias", tile(t[:, None], 0, 1)[:, 0]
    if name == "conv1d.weight":
        w = t.squeeze(1)
        return "ssm_conv1d.weight", torch.cat([w[:qk], tile(w[qk:], 0, vd)])
    if name == "out_proj.weight":
        return "ssm_out.weight", tile(t, 1, vd)
    raise KeyError(name)


def _layer_tensor(rest: str, t: torch.Tensor, cfg) -> list[tuple[str, torch.Tensor]]:
    """One parameter of a decoder layer (`rest`: its name after `model.layers.{i}.`) -> [(name, tensor)]."""
    part, _, leaf = rest.partition(".")
    if part in HC:
        w = t + 1 if leaf == "hc_norm.weight" else t
        return [(f"{HC[part]}_{HC_PARTS[leaf]}.weight", w)]
    if rest in RENAME:
        return [(RENAME[rest], t)]
    if rest in PLUS_ONE:
        return [(PLUS_ONE[rest], t + 1)]
    if part == "linear_attn":
        return [_gdn(leaf, t, cfg)]
    if rest == "self_attn.indexer.index_qk_proj.weight":
        n_q = cfg.indexer_n_heads * cfg.indexer_head_dim
        return [("indexer.q_proj.weight", t[:n_q]), ("indexer.k_proj.weight", t[n_q:])]
    if rest == "mlp.experts.gate_up_proj":
        inter = t.shape[1] // 2
        return [("ffn_gate_exps.weight", t[:, :inter]), ("ffn_up_exps.weight", t[:, inter:])]
    if rest == "mlp.shared_expert_gate.weight":
        return [("ffn_gate_inp_shexp.weight", t.reshape(-1))]
    if rest == "ple.conv1d.weight":
        return [("ple_conv1d.weight", t.squeeze(1))]
    if rest.startswith("ple.ple_embedding.ngram_embedding."):
        return [("@ple_table", t)]  # global: see `convert`
    raise KeyError(rest)


def _final(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", t
    if name == "lm_head.weight":
        return "output.weight", t
    leaf = name.removeprefix("model.hyper_connection_mixer.")
    if leaf in HC_PARTS and leaf != "block_inject_weight.weight":
        return f"output_hc_{HC_PARTS[leaf]}.weight", (t + 1 if leaf == "hc_norm.weight" else t)
    raise KeyError(name)


def convert(model, dtype: torch.dtype) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """(metadata, [(name, tensor)]) of `model` (a `FlashNextForCausalLM` with in-memory tables) for llama.cpp.

    Raises:
        ValueError: a config llama.cpp cannot run (`check_supported`), or a parameter this mapping does not place.
    """
    cfg = model.config
    check_supported(cfg)
    out, unplaced = [], []
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if not t.is_floating_point():
            continue  # the n-gram hash constants: metadata
        try:
            if name.startswith("model.layers."):
                i, rest = name.removeprefix("model.layers.").split(".", 1)
                out += [(n if n.startswith("@") else f"blk.{i}.{n}", x) for n, x in _layer_tensor(rest, t, cfg)]
            else:
                out.append(_final(name, t))
        except KeyError:
            unplaced.append(name)
    if unplaced:
        raise ValueError(f"no llama.cpp tensor for {unplaced}")
    ple = [x for n, x in out if n == "@ple_table"]
    out = [(n, x) for n, x in out if n != "@ple_table"]
    if ple:
        out.append(("per_layer_token_embd.weight", ple[0]))
    cast = [(n, x.float() if x.dim() < 2 or any(k in n for k in KEEP_F32) else x.to(dtype)) for n, x in out]
    return metadata(model, dtype), [(n, x.contiguous()) for n, x in cast]


def byte_chars() -> list[str]:
    """The 256 single-character strings a byte-level BPE vocabulary uses for bytes 0..255: printable Latin-1
    bytes stand for themselves, the others for code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def vocab(size: int) -> list[str]:
    """Token strings of a synthetic vocabulary (the benchmark's ids are random; llama.cpp needs a vocabulary to
    load): the 256 byte tokens first, then `<t{i}>`."""
    chars = byte_chars() if size >= 256 else []
    return chars + [f"<t{i}>" for i in range(len(chars), size)]


def _ple_metadata(model, arch: str) -> dict:
    cfg = model.config
    layer = cfg.ple_layer_ids[0] - 1  # 1-based in the config
    emb = model.model.layers[layer].ple.ple_embedding
    return {
        f"{arch}.ple.layers": Typed(ARRAY, [layer], I32),
        f"{arch}.ple.ngram_size": cfg.ngram_size,
        f"{arch}.ple.heads_per_ngram": cfg.heads_per_ngram,
        f"{arch}.ple.conv_kernel": cfg.ple_conv_kernel_size,
        f"{arch}.ple.eos_token_id": cfg.eos_id,
        f"{arch}.embedding_length_per_layer_input": emb.ngram_embedding.embedding_dim,
        # uint64, as llama.cpp reads (and its saver writes) it; the multipliers are positive
        f"{arch}.ple.layer_multipliers": Typed(ARRAY, emb.layer_multipliers.tolist(), U64),
        f"{arch}.ple.head_offsets": Typed(ARRAY, emb.ngram_heads_offsets.tolist(), U64),
        f"{arch}.ple.head_vocab_sizes": Typed(ARRAY, emb.ngram_heads_vocab_sizes.tolist(), U64),
    }


def metadata(model, dtype: torch.dtype, arch: str = "qwen4exp") -> dict:
    """The GGUF key/value metadata of `model` for llama.cpp's `arch` loader (hyperparameters, PLE constants,
    a synthetic vocabulary)."""
    cfg = model.config
    qsa = [i for i, t in enumerate(cfg.layer_types) if t != "linear_attention"]
    a = arch
    meta = {
        "general.architecture": a,
        "general.name": "flashnext-benchmark",
        "general.file_type": FILE_TYPE[dtype],
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.feed_forward_length": cfg.shared_expert_intermediate_size,
        f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        f"{a}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
        f"{a}.expert_count": cfg.num_experts,
        f"{a}.expert_used_count": cfg.num_experts_per_tok,
        f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.dimension_count": cfg.rotary_dim,
        # text positions are equal on the three MRoPE axes, where interleaved MRoPE is the plain rotary: one section
        f"{a}.rope.dimension_sections": Typed(ARRAY, [cfg.rotary_dim // 2, 0, 0, 0], I32),
        f"{a}.ssm.conv_kernel": cfg.linear_conv_kernel_dim,
        f"{a}.ssm.state_size": cfg.linear_key_head_dim,
        f"{a}.ssm.group_count": cfg.linear_num_key_heads,
        f"{a}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{a}.ssm.inner_size": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
        f"{a}.full_attention_interval": qsa[0] + 1,
        f"{a}.hyper_connection.count": cfg.hc_count,
        f"{a}.hyper_connection.low_rank": cfg.hc_lowrank,
        f"{a}.attention.indexer.head_count": cfg.indexer_n_heads,
        f"{a}.attention.indexer.key_length": cfg.indexer_head_dim,
        f"{a}.attention.indexer.top_k": cfg.indexer_budget,
        f"{a}.attention.compress_ratios": Typed(
            ARRAY, [cfg.indexer_compress_ratio if i in qsa else 0 for i in range(cfg.num_hidden_layers)], I32
        ),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": Typed(ARRAY, vocab(cfg.vocab_size), STRING),
        "tokenizer.ggml.token_type": Typed(ARRAY, [1] * cfg.vocab_size, I32),
        "tokenizer.ggml.merges": Typed(ARRAY, [], STRING),
        "tokenizer.ggml.eos_token_id": cfg.eos_id,
        "tokenizer.ggml.bos_token_id": cfg.eos_id,
        "tokenizer.ggml.add_bos_token": False,
    }
    if cfg.ple_layer_ids:
        meta.update(_ple_metadata(model, a))
    return meta
