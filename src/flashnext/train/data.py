"""SFT datasets from JSONL: one `Example` (token ids + labels) per line.

Each non-blank line is one JSON object of one of three kinds, detected from its keys:

- `{"prompt": str, "completion": str}`: `encode(prompt) + encode(completion)` (+ the tokenizer's
  `eos_token_id`, if it has one and `add_eos`); loss on the completion (and EOS) only. The two texts are encoded
  separately so the boundary is exact; a tokenizer that adds special tokens in `encode` adds them to both.
- `{"messages": [{"role": str, "content": str}, ...]}`: rendered with `tokenizer.apply_chat_template`; loss only on
  assistant turns. A turn's tokens are found by rendering prefixes: assistant message i spans
  `[len(render(messages[:i], add_generation_prompt=True)), len(render(messages[:i + 1])))` of the full rendering,
  so the role header is prompt and the turn's end marker is trained. Each prefix rendering must be a prefix of the
  full one; templates that rewrite earlier turns (e.g. dropping past reasoning) are rejected with an error.
- image rows: `{"messages": [...]}` whose user/system contents are lists of text and image parts (a local path or
  a data: URL), for a composite model: `train/images.py`.
- `{"input_ids": [int, ...], "labels": [int, ...]}`: pre-tokenized; `labels` (same length, -100 = no loss) is
  optional and defaults to every token.
- RL rollouts are pre-tokenized lines with, in addition, `"inference_logprobs": [float, ...]` (entry t is the
  inference engine's log-probability of `input_ids[t]`; any value on prompt tokens), `"advantages"` (one float
  for the whole sequence or one per token) and optionally `"routed_experts": [[[int] * top_k] * n_moe_layers]`
  per token (the experts the engine used, replayed by the trainer's router).

Labels are not shifted: `labels[t]` is token t where it carries loss, -100 elsewhere; the loss
(`batch.next_token_targets`) makes token t predict `labels[t + 1]`.
Malformed lines raise `InputError` naming the file, the line number and the problem: invalid UTF-8 or JSON, a
wrong type or length, and (given the model's `ModelLimits`) an id outside the vocabulary or a `routed_experts`
entry outside the model's experts/layers/top-k. Every line is checked at load time, so a bad id deep in a large
file stops the run before its first step instead of when its micro-batch trains; with `skip_bad` (the config's
`data.bad_rows = "skip"`) each bad line is reported as a warning with its file and line and left out instead.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flashnext.errors import InputError
from flashnext.train.images import has_images, image_messages

IGNORE = -100
KINDS = ('{"prompt", "completion"}', '{"messages"}', '{"input_ids"[, "labels"]}')


class Tokenizer(Protocol):
    """What the loader needs of a tokenizer (Hugging Face tokenizers qualify)."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ModelLimits:
    """What the ids of a record must fit: the model's vocabulary and the shape of its MoE routing.

    Attributes:
        vocab_size: ids (`input_ids`, `labels` other than -100) must be in `[0, vocab_size)`.
        num_layers: `routed_experts` has one row per decoder layer (every layer is MoE).
        num_experts: expert ids must be in `[0, num_experts)`.
        top_k: experts per token and layer (`num_experts_per_tok`).
    """

    vocab_size: int
    num_layers: int
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, cfg: Any) -> ModelLimits:
        """The limits of a `TextConfig`."""
        return cls(cfg.vocab_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok)


@dataclass(frozen=True)
class Example:
    """One training sequence.

    Attributes:
        input_ids: token ids [n].
        labels: [n], the token id where it carries loss, -100 on prompt tokens.
        advantages: RL only, [n] per-token advantages.
        inference_logprobs: RL only, [n]; entry t is the engine's log-probability of `input_ids[t]`.
        routed_experts: RL only (optional), [n][n_moe_layers][top_k] experts to replay.
        images: an image row's pixels, grids and 3-D positions (`train.images.RowImages`), else None.
    """

    input_ids: list[int]
    labels: list[int]
    advantages: list[float] | None = None
    inference_logprobs: list[float] | None = None
    routed_experts: list[list[list[int]]] | None = None
    images: Any = field(default=None, compare=False)

    def __len__(self) -> int:
        return len(self.input_ids)

    def truncated(self, n: int) -> Example:
        """The first `n` tokens of this example (every per-token field cut alike); an image row is never cut."""
        if self.images is not None and n < len(self):
            raise InputError(f"an image row of {len(self)} tokens cannot be cut to {n} (its images would be cut)")
        cut = lambda x: None if x is None else x[:n]
        return Example(
            self.input_ids[:n],
            self.labels[:n],
            cut(self.advantages),
            cut(self.inference_logprobs),
            cut(self.routed_experts),
            self.images,
        )


def load_jsonl(
    path: str | Path,
    tokenizer: Any = None,
    add_eos: bool = True,
    limits: ModelLimits | None = None,
    images: Any = None,
    skip_bad: bool = False,
) -> list[Example]:
    """Read a JSONL dataset (see the module docstring for the three line kinds).

    Args:
        path: the `.jsonl` file (UTF-8, an optional BOM); blank lines are skipped.
        tokenizer: object with `encode(text) -> list[int]` (prompt/completion) and
            `apply_chat_template(messages, tokenize=True, ...)` (messages); not needed for pre-tokenized lines.
        add_eos: append `tokenizer.eos_token_id` (when not None) to completions.
        limits: the model's vocabulary and routing shape; every id of every line is checked against them.
        images: `train.images.ImageRows` for image rows (a composite model), None for a text model.
        skip_bad: warn `"<path>:<line>: <problem> (row skipped)"` for each malformed line and leave it out.

    Raises:
        InputError: `"<path>:<line>: <problem>"` for the first malformed line (unless `skip_bad`).
    """
    path = Path(path)
    out = []
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is reported with its number
        for lineno, raw in enumerate(f, start=1):
            try:
                line = _decode(raw, first=lineno == 1)
                if line.strip():
                    out.append(parse_record(_loads(line), tokenizer, add_eos, limits, images))
            except InputError as e:
                if not skip_bad:
                    raise InputError(f"{path}:{lineno}: {e}") from None
                warnings.warn(f"{path}:{lineno}: {e} (row skipped)", stacklevel=2)
    return out


def _decode(raw: bytes, first: bool) -> str:
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)") from None


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"invalid JSON ({e.msg} at column {e.colno})") from None


def parse_record(
    record: Any, tokenizer: Any = None, add_eos: bool = True, limits: ModelLimits | None = None, images: Any = None
) -> Example:
    """Turn one decoded JSON line into an `Example` (raises `InputError` without the file position).

    With `limits`, every id (`input_ids`, `labels`, `routed_experts`) is checked against the model's.
    """
    if not isinstance(record, Mapping):
        raise InputError(f"expected a JSON object, got {type(record).__name__}")
    keys = set(record)
    if "input_ids" in keys:
        ex = _pretokenized(record)
    elif "messages" in keys and has_images(record["messages"]):
        _need(tokenizer, "apply_chat_template", '"messages"')
        ids, labels, row_images = image_messages(record["messages"], tokenizer, images, IGNORE)
        ex = Example(ids, labels, images=row_images)
    elif "messages" in keys:
        ex = _messages(record["messages"], tokenizer)
    elif {"prompt", "completion"} <= keys:
        ex = _prompt_completion(record, tokenizer, add_eos)
    else:
        raise InputError(f"unknown record with keys {sorted(keys)}; expected one of {', '.join(KINDS)}")
    if not ex.input_ids:
        raise InputError("record has no tokens")
    check_ids(ex, limits)
    return ex


def check_ids(ex: Example, limits: ModelLimits | None) -> None:
    """Raise `InputError` naming the field, position and value of the first id outside the model's limits
    (labels are checked for stray negative values even without limits)."""
    vocab = limits.vocab_size if limits else None
    if vocab is not None and max(ex.input_ids) >= vocab:  # first: labels default to the ids
        t = next(t for t, v in enumerate(ex.input_ids) if v >= vocab)
        raise InputError(f"'input_ids' has id {ex.input_ids[t]} at position {t} >= the model's vocab_size={vocab}")
    bad = [t for t, v in enumerate(ex.labels) if v != IGNORE and (v < 0 or (vocab is not None and v >= vocab))]
    if bad:
        t = bad[0]
        bound = f"an id < the model's vocab_size={vocab}" if limits else "a non-negative id"
        raise InputError(f"'labels' has {ex.labels[t]} at position {t}; expected {IGNORE} (no loss) or {bound}")
    if limits is not None and ex.routed_experts is not None:
        _check_routing(ex.routed_experts, limits)


def _check_routing(routed: list, limits: ModelLimits) -> None:
    L, k, E = limits.num_layers, limits.top_k, limits.num_experts
    for t, token in enumerate(routed):
        if len(token) != L:
            raise InputError(
                f"'routed_experts' token {t} has {len(token)} layer rows; the model has num_hidden_layers={L}"
            )
        for layer, experts in enumerate(token):
            if len(experts) != k:
                raise InputError(
                    f"'routed_experts' token {t} layer {layer} has {len(experts)} experts; the model routes each "
                    f"token to num_experts_per_tok={k}"
                )
            bad = [e for e in experts if not 0 <= e < E]
            if bad:
                raise InputError(
                    f"'routed_experts' token {t} layer {layer} has expert id {bad[0]}; the model's experts are "
                    f"0..{E - 1} (num_experts={E})"
                )


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InputError(f"{name!r} must be a list of integers, got {str(value)[:80]}")
    return value


def _pretokenized(record: Mapping) -> Example:
    ids = _int_list(record["input_ids"], "input_ids")
    if any(t < 0 for t in ids):
        raise InputError(f"'input_ids' has a negative id {min(ids)}")
    if record.get("labels") is None:
        labels = list(ids)
    else:
        labels = _int_list(record["labels"], "labels")
        if len(labels) != len(ids):
            raise InputError(f"'labels' has {len(labels)} entries, 'input_ids' has {len(ids)}")
    if not {"advantages", "inference_logprobs", "routed_experts"} & set(record):
        return Example(list(ids), list(labels))
    return Example(list(ids), list(labels), *_rl_fields(record, len(ids)))


def _float_list(value: Any, name: str, n: int) -> list[float]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [float(value)] * n
    if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise InputError(f"{name!r} must be a number or a list of numbers, got {str(value)[:80]}")
    if len(value) != n:
        raise InputError(f"{name!r} has {len(value)} entries, 'input_ids' has {n}")
    return [float(v) for v in value]


def _rl_fields(record: Mapping, n: int) -> tuple[list[float], list[float], list | None]:
    for key in ("advantages", "inference_logprobs"):
        if key not in record:
            raise InputError(f"RL record needs {key!r} (it has {sorted(record)})")
    advantages = _float_list(record["advantages"], "advantages", n)
    if not isinstance(record["inference_logprobs"], list):
        raise InputError("'inference_logprobs' must be a list with one log-probability per token")
    logprobs = _float_list(record["inference_logprobs"], "inference_logprobs", n)
    routed = record.get("routed_experts")
    if routed is not None:
        is_int = lambda e: isinstance(e, int) and not isinstance(e, bool)
        ok = isinstance(routed, list) and len(routed) == n
        ok = ok and all(
            isinstance(t, list) and all(isinstance(r, list) and all(map(is_int, r)) for r in t) for t in routed
        )
        if not ok:
            raise InputError(f"'routed_experts' must be [{n} tokens][moe layers][top_k] integers")
    return advantages, logprobs, routed


def _need(tokenizer: Any, method: str, kind: str) -> None:
    if tokenizer is None or not callable(getattr(tokenizer, method, None)):
        raise InputError(f"{kind} records need a tokenizer with `{method}`")


def _prompt_completion(record: Mapping, tokenizer: Any, add_eos: bool) -> Example:
    for key in ("prompt", "completion"):
        if not isinstance(record[key], str):
            raise InputError(f"{key!r} must be a string, got {type(record[key]).__name__}")
    _need(tokenizer, "encode", '"prompt"/"completion"')
    prompt = list(tokenizer.encode(record["prompt"]))
    completion = list(tokenizer.encode(record["completion"]))
    eos = getattr(tokenizer, "eos_token_id", None)
    if add_eos and isinstance(eos, int):
        completion.append(eos)
    return Example(prompt + completion, [IGNORE] * len(prompt) + completion)


def _render(tokenizer: Any, messages: list, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, Mapping):  # transformers may return a BatchEncoding
        out = out["input_ids"]
    return list(out)


def _messages(messages: Any, tokenizer: Any) -> Example:
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"messages[{i}] must be an object with string 'role' and 'content', got {str(m)[:80]}")
    _need(tokenizer, "apply_chat_template", '"messages"')
    full = _render(tokenizer, messages, add_generation_prompt=False)
    labels = [IGNORE] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        end = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(end)] != end or end[: len(start)] != start:
            raise InputError(
                f"chat template is not prefix-stable at messages[{i}]: rendering the conversation up to this turn "
                "is not a prefix of the full rendering"
            )
        labels[len(start) : len(end)] = full[len(start) : len(end)]
    return Example(full, labels)
