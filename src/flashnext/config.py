"""Model configs parsed from a checkpoint's `config.json` (text `qwen4_exp_text` or composite `qwen4_exp`).

Field names follow the official `config.json` so a config round-trips through `to_dict()` unchanged.
`validate()` checks every invariant the reference checks and raises `ConfigError` naming field and value.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.errors import ConfigError

LINEAR = "linear_attention"
INDEXED = "indexed_attention"


@dataclass
class TextConfig:
    """Decoder geometry of Qwen3.8-Flash-Next (`model_type` `qwen4_exp_text`)."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] | None = None
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None
    full_attention_interval: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.layer_types is None:
            n = self.full_attention_interval
            if not isinstance(n, int) or n <= 0:
                raise ConfigError(f"full_attention_interval must be a positive int, got {n!r}")
            self.layer_types = [LINEAR if (i + 1) % n else INDEXED for i in range(self.num_hidden_layers)]
        else:
            # Real checkpoints spell indexed (QSA) layers "full_attention".
            self.layer_types = [INDEXED if t == "full_attention" else t for t in self.layer_types]
        self.validate()

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def partial_rotary_factor(self) -> float:
        return float(self.rope_parameters.get("partial_rotary_factor", 1.0))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> list[int]:
        return list(self.rope_parameters.get("mrope_section", [11, 11, 10]))

    @property
    def gate_act(self) -> str:
        return self.output_gate_type or self.hidden_act

    @property
    def eos_id(self) -> int | None:
        """The single EOS id the n-gram hash treats as a boundary (the first one when a list is given)."""
        eos = self.eos_token_id
        if isinstance(eos, list):
            return eos[0] if eos else None
        return eos

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def qsa_enabled(self) -> bool:
        return self.indexer_n_heads is not None

    # ---- validation ---------------------------------------------------------------------------------
    def validate(self) -> None:
        bad = sorted(set(self.layer_types) - {LINEAR, INDEXED})
        if bad:
            raise ConfigError(f"layer_types: unsupported layer type(s) {bad}; expected {LINEAR!r} or {INDEXED!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}"
            )
        if self.gate_act not in ("sigmoid", "silu"):
            raise ConfigError(f"output_gate_type={self.gate_act!r}: expected 'sigmoid' or 'silu'")
        if self.hc_count <= 1:
            raise ConfigError(f"hc_count must be > 1, got hc_count={self.hc_count}")
        if self.num_experts <= 0:
            raise ConfigError(f"num_experts must be > 0, got num_experts={self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got num_experts_per_tok={self.num_experts_per_tok}"
            )
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {name}={getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        self._validate_qsa()
        self._validate_ple()

    def _validate_qsa(self) -> None:
        names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        values = {n: getattr(self, n) for n in names}
        if all(v is None for v in values.values()):
            if INDEXED in self.layer_types:
                raise ConfigError(
                    "layer_types has indexed_attention layers but the QSA indexer fields are unset: "
                    f"{[n for n in names]}"
                )
            return
        missing = [n for n, v in values.items() if v is None]
        if missing:
            raise ConfigError(f"QSA config is missing required fields {missing} (QSA fields are all-or-none)")
        nonpos = {n: v for n, v in values.items() if v <= 0}
        if nonpos:
            raise ConfigError(f"QSA config values must be positive, got {nonpos}")
        if self.indexer_kv_heads != 1:
            raise ConfigError(f"indexer_kv_heads must be 1, got indexer_kv_heads={self.indexer_kv_heads}")
        if self.indexer_budget % self.indexer_compress_ratio:
            raise ConfigError(
                f"indexer_budget={self.indexer_budget} is not divisible by "
                f"indexer_compress_ratio={self.indexer_compress_ratio}"
            )
        if self.rotary_dim > self.indexer_head_dim:
            raise ConfigError(
                f"rotary dim {self.rotary_dim} (head_dim={self.head_dim} x partial_rotary_factor="
                f"{self.partial_rotary_factor}) exceeds indexer_head_dim={self.indexer_head_dim}"
            )

    def _validate_ple(self) -> None:
        if not self.ple_layer_ids:
            return
        heads = self.ngram_heads
        if heads <= 0 or self.ple_embed_dim <= 0 or self.ple_embed_dim % heads:
            raise ConfigError(
                f"ple_embed_dim={self.ple_embed_dim} must be positive and divisible by the number of n-gram heads "
                f"(ngram_size-1)*heads_per_ngram={heads}"
            )
        out_of_range = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
        if out_of_range:
            raise ConfigError(f"ple_layer_ids are one-indexed in [1, {self.num_hidden_layers}], got {out_of_range}")
        not_linear = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != LINEAR]
        if not_linear:
            raise ConfigError(f"ple_layer_ids {not_linear} are not linear_attention layers (PLE needs one)")
        if self.eos_id is None:
            raise ConfigError(f"eos_token_id must be set when PLE is enabled, got eos_token_id={self.eos_token_id!r}")

    # ---- (de)serialisation --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known and k != "model_type"}
        # Older configs keep rope fields at the top level.
        if kwargs.get("rope_parameters") is None and ("rope_theta" in extra or "partial_rotary_factor" in extra):
            kwargs["rope_parameters"] = {
                "rope_type": "default",
                "rope_theta": extra.pop("rope_theta", 10000.0),
                "partial_rotary_factor": extra.pop("partial_rotary_factor", 1.0),
            }
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.pop("full_attention_interval")
        out.update(self.extra)
        out["model_type"] = "qwen4_exp_text"
        return out


@dataclass
class VisionConfig:
    """Vision tower geometry (`model_type` `qwen4_exp_vision`); defaults are the reference's.

    Only read from a checkpoint: `ModelConfig.vision` keeps the raw dict so a config round-trips unchanged.
    """

    depth: int = 27
    """Number of transformer blocks."""
    hidden_size: int = 1152
    """Width of the vision blocks."""
    hidden_act: str = "gelu_pytorch_tanh"
    """Activation of the block MLPs (the merger always uses exact GELU, as the reference)."""
    intermediate_size: int = 4304
    """Width of the block MLPs."""
    num_heads: int = 16
    """Attention heads per block (head dim = hidden_size / num_heads)."""
    in_channels: int = 3
    """Image channels."""
    patch_size: int = 16
    """Spatial side of one patch, in pixels."""
    spatial_merge_size: int = 2
    """Side of the square of patches the merger folds into one text token."""
    temporal_patch_size: int = 2
    """Frames per patch (an image is repeated to fill them)."""
    out_hidden_size: int = 3584
    """Merger output width: the text model's hidden size."""
    num_position_embeddings: int = 2304
    """Rows of the learned position table: a square grid of side sqrt(num_position_embeddings)."""
    rope_theta: float = 10000.0
    """Base of the axial 2-D rotary embedding."""

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"vision_config.hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(
                f"vision head dim {self.hidden_size // self.num_heads} must be a multiple of 4 (axial 2-D rotary)"
            )
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ConfigError(
                f"vision_config.num_position_embeddings={self.num_position_embeddings} is not a square number"
            )
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"vision_config.hidden_act={self.hidden_act!r}: expected 'gelu_pytorch_tanh' or 'gelu'")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(data.get(key), list | tuple):
                raise ConfigError(f"vision_config.{key}={data[key]!r}: only a single int is supported")
        rope = data.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config.rope_parameters.rope_type={rope['rope_type']!r}: expected 'axial'")
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclass
class ModelConfig:
    """What a checkpoint directory holds: the text config, plus the composite wrapper fields when present.

    `composite` is True for `model_type` `qwen4_exp` (weights under `model.language_model.*`).
    """

    text: TextConfig
    composite: bool = False
    language_model_only: bool = False
    vision: dict[str, Any] | None = None
    top: dict[str, Any] = field(default_factory=dict)

    @property
    def vision_config(self) -> VisionConfig | None:
        """The parsed vision tower config, or None (text checkpoint, no `vision_config`, `language_model_only`)."""
        if not self.composite or self.vision is None or self.language_model_only:
            return None
        return VisionConfig.from_dict(self.vision)

    @property
    def image_token_id(self) -> int:
        return int(self.top.get("image_token_id", 248056))

    @property
    def vision_start_token_id(self) -> int:
        return int(self.top.get("vision_start_token_id", 248053))

    @property
    def vision_end_token_id(self) -> int:
        return int(self.top.get("vision_end_token_id", 248054))

    def to_dict(self) -> dict[str, Any]:
        if not self.composite:
            out = self.text.to_dict()
            out.setdefault("architectures", ["Qwen4ExpForCausalLM"])
            return out
        out = dict(self.top)
        out["model_type"] = "qwen4_exp"
        out["text_config"] = self.text.to_dict()
        if self.vision is not None:
            out["vision_config"] = self.vision
        return out


def parse_config(data: dict[str, Any]) -> ModelConfig:
    """Parse a `config.json` dict (text or composite) into a `ModelConfig`."""
    model_type = data.get("model_type", "qwen4_exp_text")
    if model_type == "qwen4_exp_text":
        return ModelConfig(text=TextConfig.from_dict(data))
    if model_type == "qwen4_exp":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"composite config (model_type='qwen4_exp') needs a text_config dict, got {text!r}")
        top = {k: v for k, v in data.items() if k not in ("text_config", "vision_config")}
        return ModelConfig(
            text=TextConfig.from_dict(text),
            composite=True,
            language_model_only=bool(data.get("language_model_only", False)),
            vision=data.get("vision_config"),
            top=top,
        )
    raise ConfigError(f"model_type={model_type!r}: expected 'qwen4_exp_text' or 'qwen4_exp'")


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r}")
    return parse_config(json.loads(path.read_text()))


def tiny_config_dict() -> dict[str, Any]:
    """The embedded tiny default's `config.json` (package data `flashnext/configs/tiny.json`): the one reader."""
    from importlib import resources

    return json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())


def tiny_config() -> TextConfig:
    """The embedded tiny default (`flashnext/configs/tiny.json`)."""
    return parse_config(tiny_config_dict()).text
