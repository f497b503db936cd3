"""The rules `flashnext.config` checks a config with: one `Rule` per field (`check_fields`), and the text
config's cross-field invariants (`validate_text`). The names are re-exported by `flashnext.config`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from flashnext.errors import ConfigError

LINEAR = "linear_attention"
INDEXED = "indexed_attention"


# ---- field rules ------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON `true` is a bool, never a count


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)  # json reads NaN/Infinity


@dataclass(frozen=True)
class Rule:
    """What one config field must hold: `ok(value)`, and `what` names it in the error ("a positive int")."""

    what: str
    ok: Callable[[Any], bool]

    def or_null(self) -> Rule:
        return Rule(f"{self.what} or null", lambda v: v is None or self.ok(v))


def one_of(*choices: str) -> Rule:
    return Rule(f"one of {list(choices)}", lambda v: isinstance(v, str) and v in choices)


def list_of(rule: Rule, what: str, length: int | None = None) -> Rule:
    size = "" if length is None else f" of length {length}"
    return Rule(
        f"a list{size} of {what}",
        lambda v: isinstance(v, list) and (length is None or len(v) == length) and all(rule.ok(x) for x in v),
    )


INT = Rule("an int", _is_int)
POS_INT = Rule("a positive int", lambda v: _is_int(v) and v > 0)
TOKEN_ID = Rule("a non-negative int", lambda v: _is_int(v) and v >= 0)
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
OBJECT = Rule("an object", lambda v: isinstance(v, dict))
POS_NUMBER = Rule("a positive finite number", lambda v: _is_number(v) and v > 0)
NONNEG_NUMBER = Rule("a finite number >= 0", lambda v: _is_number(v) and v >= 0)

# Named rules of `TextConfig`'s fields (each field states its rule: `ruled`; `TEXT_FIELDS` collects them).
POS_INT_OR_NULL = POS_INT.or_null()
TOKEN_ID_OR_NULL = TOKEN_ID.or_null()  # also the MTP layer counts (`TextConfig.mtp_layers`); null: no MTP head
OBJECT_OR_NULL = OBJECT.or_null()  # `rope_parameters` (its keys: ROPE_FIELDS), `mtp` (its keys: MTP_FIELDS)
HC_COUNT = Rule("an int > 1", lambda v: _is_int(v) and v > 1)
DROPOUT = Rule("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1)
# The MLPs, experts and convs are SiLU-gated in our kernels; another activation would compute silently wrong.
SILU_ONLY = one_of("silu")
GATE_TYPE = one_of("sigmoid", "silu").or_null()
LAYER_TYPES = list_of(
    one_of(LINEAR, INDEXED, "full_attention"), f"{LINEAR!r}, {INDEXED!r} or 'full_attention'"
).or_null()
PLE_LAYER_IDS = list_of(INT, "ints").or_null()  # the range [1, num_hidden_layers] is checked in validate_text
EOS_IDS = Rule(
    "a non-negative int, a list of them, or null",
    lambda v: v is None or TOKEN_ID.ok(v) or list_of(TOKEN_ID, "").ok(v),
)


def ruled(default: Any, rule: Rule) -> Any:
    """A dataclass field whose value must pass `rule`: the field and its rule stated once (`field_rules`)."""
    return field(default=default, metadata={"rule": rule})


def field_rules(cls) -> dict[str, Rule]:
    """Field name -> `Rule` of a dataclass' `ruled` fields, in field order."""
    return {f.name: f.metadata["rule"] for f in fields(cls) if "rule" in f.metadata}

# Keys of a nested `mtp` object we read (others are kept). Its layers are attention layers (QSA) of the model's own
# geometry and rotary, so `layer_types` and `rope_theta` may only restate that.
MTP_FIELDS: dict[str, Rule] = {
    "num_hidden_layers": TOKEN_ID,
    "layer_types": list_of(one_of(INDEXED, "full_attention"), f"'full_attention' or {INDEXED!r}"),
    "rope_theta": POS_NUMBER,
    "hybrid": BOOL,
}
MTP_SPELLINGS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "mtp.num_hidden_layers")

# Keys of `rope_parameters` we read (others, e.g. `mrope_interleaved`, are kept but do not change the math).
ROPE_FIELDS: dict[str, Rule] = {
    "rope_type": one_of("default"),  # the only rotary the reference's text model computes without scaling
    "rope_theta": POS_NUMBER,
    "partial_rotary_factor": Rule("a number in (0, 1]", lambda v: _is_number(v) and 0 < v <= 1),
    "mrope_section": list_of(TOKEN_ID, "non-negative ints", length=3),
}


def check_fields(values: dict[str, Any], rules: dict[str, Rule], where: str = "") -> None:
    """Raise `ConfigError` for the first of `values` (name -> value) that breaks its rule; unruled names pass.

    Args:
        values: field values, e.g. a config.json object or a dataclass' fields.
        rules: field name -> `Rule`.
        where: prefix of the field name in the message (`"rope_parameters."`).
    """
    for name, value in values.items():
        rule = rules.get(name)
        if rule is not None and not rule.ok(value):
            raise ConfigError(f"{where}{name} must be {rule.what}, got {value!r}")


# ---- cross-field checks of a TextConfig ---------------------------------------------------------
def validate_text(cfg) -> None:
    """`TextConfig.validate`: the cross-field invariants (the reference's and the ones our kernels rely on)."""
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(
            f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers={cfg.num_hidden_layers}"
        )
    if cfg.gate_act not in ("sigmoid", "silu"):
        raise ConfigError(f"output_gate_type={cfg.gate_act!r}: expected 'sigmoid' or 'silu'")
    if cfg.rotary_dim <= 0 or cfg.rotary_dim % 2:
        raise ConfigError(
            f"rotary dim {cfg.rotary_dim} (head_dim={cfg.head_dim} x rope_parameters.partial_rotary_factor="
            f"{cfg.partial_rotary_factor}) must be a positive even number"
        )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(
            f"num_experts_per_tok must be in [1, num_experts={cfg.num_experts}], "
            f"got num_experts_per_tok={cfg.num_experts_per_tok}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"linear_num_value_heads={cfg.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads={cfg.linear_num_key_heads}"
        )
    _validate_qsa(cfg)
    _validate_ple(cfg)
    _validate_mtp(cfg)

def _validate_qsa(cfg) -> None:
    names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    values = {n: getattr(cfg, n) for n in names}
    if all(v is None for v in values.values()):
        if INDEXED in cfg.layer_types:
            raise ConfigError(
                "layer_types has indexed_attention layers but the QSA indexer fields are unset: "
                f"{[n for n in names]}"
            )
        return
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise ConfigError(f"QSA config is missing required fields {missing} (QSA fields are all-or-none)")
    if cfg.indexer_kv_heads != 1:
        raise ConfigError(f"indexer_kv_heads must be 1, got indexer_kv_heads={cfg.indexer_kv_heads}")
    if cfg.indexer_budget % cfg.indexer_compress_ratio:
        raise ConfigError(
            f"indexer_budget={cfg.indexer_budget} is not divisible by "
            f"indexer_compress_ratio={cfg.indexer_compress_ratio}"
        )
    if cfg.rotary_dim > cfg.indexer_head_dim:
        raise ConfigError(
            f"rotary dim {cfg.rotary_dim} (head_dim={cfg.head_dim} x partial_rotary_factor="
            f"{cfg.partial_rotary_factor}) exceeds indexer_head_dim={cfg.indexer_head_dim}"
        )

def _validate_ple(cfg) -> None:
    if not cfg.ple_layer_ids:
        return
    heads = cfg.ngram_heads
    if heads <= 0 or cfg.ple_embed_dim <= 0 or cfg.ple_embed_dim % heads:
        raise ConfigError(
            f"ple_embed_dim={cfg.ple_embed_dim} must be positive and divisible by the number of n-gram heads "
            f"(ngram_size-1)*heads_per_ngram={heads}"
        )
    out_of_range = [i for i in cfg.ple_layer_ids if not 1 <= i <= cfg.num_hidden_layers]
    if out_of_range:
        raise ConfigError(f"ple_layer_ids are one-indexed in [1, {cfg.num_hidden_layers}], got {out_of_range}")
    not_linear = [i for i in cfg.ple_layer_ids if cfg.layer_types[i - 1] != LINEAR]
    if not_linear:
        raise ConfigError(f"ple_layer_ids {not_linear} are not linear_attention layers (PLE needs one)")
    if cfg.eos_id is None:
        raise ConfigError(f"eos_token_id must be set when PLE is enabled, got eos_token_id={cfg.eos_token_id!r}")

def _validate_mtp(cfg) -> None:
    if cfg.mtp is not None:
        check_fields(cfg.mtp, MTP_FIELDS, "mtp.")
    given = {name: n for name, n in cfg._mtp_counts().items() if n is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"the MTP layer count is given differently by {given}: they must agree")
    n = cfg.mtp_layers
    if n == 0:
        return
    name = next(iter(given))
    if n > 1:  # every official checkpoint has one; a draft step reuses it (several would need a schedule)
        raise ConfigError(f"{name}={n}: only one MTP layer is supported")
    if not cfg.qsa_enabled:
        raise ConfigError(
            f"{name}={n}: the MTP layer is a QSA attention layer, but the QSA indexer fields are unset"
        )
    theta = (cfg.mtp or {}).get("rope_theta", cfg.rope_theta)
    if theta != cfg.rope_theta:
        raise ConfigError(f"mtp.rope_theta={theta} differs from the model's rope_theta={cfg.rope_theta}")
    if cfg.extra.get("mtp_use_dedicated_embeddings"):  # kept in `extra`; we only build the shared embedding
        raise ConfigError("mtp_use_dedicated_embeddings=true: only the shared embed_tokens is supported")
