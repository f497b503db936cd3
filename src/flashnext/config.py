"""Model configs parsed from a checkpoint's `config.json` (text `qwen4_exp_text` or composite `qwen4_exp`).

Field names follow the official `config.json` so a config round-trips through `to_dict()` unchanged.
Every field's type and range is checked from one table per config (`TEXT_FIELDS`, `ROPE_FIELDS`,
`VISION_FIELDS`, `COMPOSITE_FIELDS`); `validate()` then checks the cross-field invariants (the reference's and
the ones our kernels rely on; the rules and these checks live in `flashnext.config_rules`). Every failure is a
`ConfigError` naming the field and value, and `load_config` prefixes the file:
`.../config.json: num_key_value_heads must be a positive int, got 0`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashnext.config_rules import (  # noqa: F401  (re-exported: `flashnext.config` names them)
    BOOL,
    DROPOUT,
    EOS_IDS,
    GATE_TYPE,
    HC_COUNT,
    INDEXED,
    INT,
    LAYER_TYPES,
    LINEAR,
    MTP_FIELDS,
    MTP_SPELLINGS,
    NONNEG_NUMBER,
    OBJECT,
    OBJECT_OR_NULL,
    PLE_LAYER_IDS,
    POS_INT,
    POS_INT_OR_NULL,
    POS_NUMBER,
    ROPE_FIELDS,
    SILU_ONLY,
    TOKEN_ID,
    TOKEN_ID_OR_NULL,
    Rule,
    check_fields,
    field_rules,
    list_of,
    one_of,
    ruled,
    validate_text,
)  # fmt: skip
from flashnext.errors import ConfigError

FULL_ATTENTION = "full_attention"  # the official spelling of an indexed (QSA) layer in `layer_types`


class _Entry:
    """A read-only attribute read from one of the config's dict fields (`rope_parameters`, a composite's `top`):
    `kind(<that dict>.get(<the attribute's name>, default))`, the reference's default where the key is absent."""

    def __init__(self, table: str, kind: type, default: Any):
        self.table, self.kind, self.default = table, kind, default

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return self.kind(getattr(obj, self.table).get(self.key, self.default))


@dataclass
class TextConfig:
    """Decoder geometry of Qwen3.8-Flash-Next (`model_type` `qwen4_exp_text`); each field with its rule."""

    vocab_size: int = ruled(248320, POS_INT)
    hidden_size: int = ruled(2048, POS_INT)
    num_hidden_layers: int = ruled(40, POS_INT)
    num_attention_heads: int = ruled(16, POS_INT)
    num_key_value_heads: int = ruled(2, POS_INT)
    head_dim: int = ruled(256, POS_INT)
    hidden_act: str = ruled("silu", SILU_ONLY)
    max_position_embeddings: int = ruled(32768, POS_INT)
    initializer_range: float = ruled(0.02, NONNEG_NUMBER)
    rms_norm_eps: float = ruled(1e-6, POS_NUMBER)
    tie_word_embeddings: bool = ruled(False, BOOL)
    rope_parameters: dict | None = ruled(None, OBJECT_OR_NULL)
    attention_bias: bool = ruled(False, BOOL)
    attention_dropout: float = ruled(0.0, DROPOUT)
    linear_conv_kernel_dim: int = ruled(4, POS_INT)
    linear_key_head_dim: int = ruled(128, POS_INT)
    linear_value_head_dim: int = ruled(128, POS_INT)
    linear_num_key_heads: int = ruled(16, POS_INT)
    linear_num_value_heads: int = ruled(32, POS_INT)
    moe_intermediate_size: int = ruled(512, POS_INT)
    shared_expert_intermediate_size: int = ruled(512, POS_INT)
    num_experts_per_tok: int = ruled(10, POS_INT)
    num_experts: int = ruled(512, POS_INT)
    norm_topk_prob: bool = ruled(True, BOOL)
    output_router_logits: bool = ruled(False, BOOL)
    router_aux_loss_coef: float = ruled(0.001, NONNEG_NUMBER)
    layer_types: list[str] | None = ruled(None, LAYER_TYPES)
    pad_token_id: int | None = ruled(None, TOKEN_ID_OR_NULL)
    bos_token_id: int | None = ruled(None, TOKEN_ID_OR_NULL)
    eos_token_id: int | list[int] | None = ruled(None, EOS_IDS)
    hc_count: int = ruled(4, HC_COUNT)
    hc_lowrank: int = ruled(320, POS_INT)
    ple_layer_ids: list[int] | None = ruled(None, PLE_LAYER_IDS)
    ple_embed_dim: int | None = ruled(None, POS_INT_OR_NULL)
    ple_conv_kernel_size: int = ruled(4, POS_INT)
    ngram_size: int = ruled(3, POS_INT)
    heads_per_ngram: int = ruled(8, POS_INT)
    ngram_vocab_size_base: int = ruled(20_000_000, POS_INT)
    make_ngram_vocab_size_divisible_by: int = ruled(128, POS_INT)
    seed: int = ruled(1234, INT)
    split_ngram_parts: int = ruled(512, POS_INT)
    indexer_n_heads: int | None = ruled(None, POS_INT_OR_NULL)
    indexer_kv_heads: int | None = ruled(None, POS_INT_OR_NULL)
    indexer_head_dim: int | None = ruled(None, POS_INT_OR_NULL)
    indexer_budget: int | None = ruled(None, POS_INT_OR_NULL)
    indexer_compress_ratio: int | None = ruled(None, POS_INT_OR_NULL)
    output_gate_type: str | None = ruled(None, GATE_TYPE)
    full_attention_interval: int = ruled(4, POS_INT)
    mtp_num_hidden_layers: int | None = ruled(None, TOKEN_ID_OR_NULL)
    num_nextn_predict_layers: int | None = ruled(None, TOKEN_ID_OR_NULL)
    mtp: dict[str, Any] | None = ruled(None, OBJECT_OR_NULL)
    layer_type_spelling: str | None = field(
        default=None, compare=False, metadata={"rule": one_of(INDEXED, FULL_ATTENTION).or_null()}
    )
    """How `layer_types` names the QSA layers in config.json (not a config.json key; not compared: presentation,
    not geometry): set from the spelling loaded (real checkpoints write `full_attention`), written back by
    `to_dict`; None (generated layer types) writes `indexed_attention`."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, TEXT_FIELDS)
        self.ple_layer_ids = sorted(set(self.ple_layer_ids or []))
        if self.ple_embed_dim is None:
            self.ple_embed_dim = self.hidden_size
        # As transformers standardises it: `rope_type` from the legacy `type` key, the default theta filled in.
        rope = dict(self.rope_parameters or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", 10000.0)
        check_fields(rope, ROPE_FIELDS, "rope_parameters.")
        self.rope_parameters = rope
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = [LINEAR if (i + 1) % n else INDEXED for i in range(self.num_hidden_layers)]
        else:
            # Real checkpoints spell indexed (QSA) layers "full_attention"; remember the spelling to write it back.
            if self.layer_type_spelling is None and isinstance(self.layer_types, list):
                self.layer_type_spelling = next((t for t in self.layer_types if t in (INDEXED, FULL_ATTENTION)), None)
            self.layer_types = [INDEXED if t == FULL_ATTENTION else t for t in self.layer_types]
        self.validate()

    # ---- derived quantities -------------------------------------------------------------------------
    rope_theta = _Entry("rope_parameters", float, 10000.0)
    partial_rotary_factor = _Entry("rope_parameters", float, 1.0)
    mrope_section = _Entry("rope_parameters", list, (11, 11, 10))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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

    @property
    def mtp_layers(self) -> int:
        """MTP (draft head) layers declared by any of the spellings `MTP_SPELLINGS`; 0 = no MTP head."""
        return next((n for n in self._mtp_counts().values() if n is not None), 0)

    def _mtp_counts(self) -> dict[str, int | None]:
        nested = (self.mtp or {}).get("num_hidden_layers")
        return dict(
            zip(MTP_SPELLINGS, (self.mtp_num_hidden_layers, self.num_nextn_predict_layers, nested), strict=True)
        )

    def validate(self) -> None:
        """The cross-field invariants (`config_rules.validate_text`); raises `ConfigError`."""
        validate_text(self)

    # ---- (de)serialisation --------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextConfig:
        """Parse a text config object (`config.json`, or a composite's `text_config`); unknown keys go to `extra`.

        Top-level `rope_theta` / `partial_rotary_factor` (older configs) are merged into `rope_parameters` as
        transformers merges them: a value already in `rope_parameters` wins. A legacy `rope_scaling` object
        stands in for `rope_parameters`, as in transformers.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"a text config must be a JSON object, got {_json_kind(data)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known and k != "model_type"}
        rope = extra.pop("rope_scaling", None) or kwargs.get("rope_parameters")
        top = {k: extra.pop(k) for k in ("rope_theta", "partial_rotary_factor") if k in extra}
        if isinstance(rope, dict) or (rope is None and top):
            kwargs["rope_parameters"] = {**top, **(rope or {})}
        elif rope is not None:
            kwargs["rope_parameters"] = rope  # not an object: the field check names it
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out.pop("full_attention_interval")
        spelling = out.pop("layer_type_spelling") or INDEXED
        out["layer_types"] = [spelling if t == INDEXED else t for t in self.layer_types]
        for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp"):  # written in the spelling given
            if out[name] is None:
                del out[name]
        out.update(self.extra)
        out["model_type"] = "qwen4_exp_text"
        return out



TEXT_FIELDS: dict[str, Rule] = field_rules(TextConfig)  # each field's rule, from its definition

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
        check_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, VISION_FIELDS, "vision_config.")
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VisionConfig:
        """Parse a composite config's `vision_config` object (unknown keys are ignored)."""
        if not isinstance(data, dict):
            raise ConfigError(f"vision_config must be a JSON object, got {_json_kind(data)}")
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(data.get(key), list | tuple):
                raise ConfigError(f"vision_config.{key}={data[key]!r}: only a single int is supported")
        rope = data.get("rope_parameters") or {}
        check_fields({"rope_parameters": rope}, {"rope_parameters": OBJECT}, "vision_config.")
        # transformers turns the vision tower's "default" rope type into its "axial" one.
        rules = {"rope_type": one_of("axial", "default"), "rope_theta": POS_NUMBER}
        check_fields(rope, rules, "vision_config.rope_parameters.")
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**kwargs, rope_theta=float(rope.get("rope_theta", 10000.0)))


VISION_FIELDS: dict[str, Rule] = {
    **dict.fromkeys(("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size"), POS_INT),
    **dict.fromkeys(("spatial_merge_size", "temporal_patch_size", "out_hidden_size"), POS_INT),
    "num_position_embeddings": POS_INT,
    "hidden_act": one_of("gelu_pytorch_tanh", "gelu"),
    "rope_theta": POS_NUMBER,
}

# The composite (`qwen4_exp`) wrapper's own keys; the text and vision objects have their own tables.
COMPOSITE_FIELDS: dict[str, Rule] = {
    "text_config": OBJECT,
    "vision_config": OBJECT.or_null(),
    "language_model_only": BOOL,
    "tie_word_embeddings": BOOL,
    **dict.fromkeys(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), TOKEN_ID),
}


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

    image_token_id = _Entry("top", int, 248056)
    vision_start_token_id = _Entry("top", int, 248053)
    vision_end_token_id = _Entry("top", int, 248054)

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


def _json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages ("a JSON array")."""
    kinds = (
        (bool, "a boolean"),
        (dict, "an object"),
        (list, "a JSON array"),
        (str, "a string"),
        (int | float, "a number"),
    )
    return next((name for t, name in kinds if isinstance(value, t)), "null" if value is None else type(value).__name__)


def parse_config(data: dict[str, Any]) -> ModelConfig:
    """Parse a `config.json` object (text or composite) into a `ModelConfig`.

    Raises:
        ConfigError: naming the bad field and value; a composite's text fields are prefixed `text_config: `.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a JSON object, got {_json_kind(data)}")
    model_type = data.get("model_type", "qwen4_exp_text")
    if model_type == "qwen4_exp_text":
        return ModelConfig(text=TextConfig.from_dict(data))
    if model_type != "qwen4_exp":
        raise ConfigError(f"model_type={model_type!r}: expected 'qwen4_exp_text' or 'qwen4_exp'")
    if "text_config" not in data:
        raise ConfigError("a composite config (model_type='qwen4_exp') needs a text_config object")
    check_fields(data, COMPOSITE_FIELDS)
    try:
        text = TextConfig.from_dict(data["text_config"])
    except ConfigError as e:
        raise ConfigError(f"text_config: {e}") from None
    top = {k: v for k, v in data.items() if k not in ("text_config", "vision_config")}
    cfg = ModelConfig(
        text=text,
        composite=True,
        language_model_only=data.get("language_model_only", False),
        vision=data.get("vision_config"),
        top=top,
    )
    if cfg.vision is not None and not cfg.language_model_only:
        VisionConfig.from_dict(cfg.vision)  # check the tower's fields now, not when a model is built
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself).

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or holds an invalid config; the message starts
            with the file's path.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"config file not found: {str(path)!r}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def tiny_config_dict() -> dict[str, Any]:
    """The embedded tiny default's `config.json` (package data `flashnext/configs/tiny.json`): the one reader."""
    from importlib import resources

    return json.loads(resources.files("flashnext").joinpath("configs/tiny.json").read_text())


def tiny_config() -> TextConfig:
    """The embedded tiny default (`flashnext/configs/tiny.json`)."""
    return parse_config(tiny_config_dict()).text
