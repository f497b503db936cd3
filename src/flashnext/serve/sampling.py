"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seeds).

Degenerate but finite values keep their limiting meaning instead of failing:
- a temperature below the smallest normal fp32 number (`GREEDY_BELOW`, about 1.2e-38; e.g. 1e-45) is greedy,
  the T -> 0 limit (in fp32 such a temperature is 0 or denormal); any larger one samples at full precision
  because logits are shifted by their maximum before the division, so `(logit - max) / T` never overflows
  (tokens far below the maximum get probability 0, the maximum keeps 1);
- a temperature beyond the fp32 range is the T -> inf limit (uniform over the tokens top-k keeps);
- a `top_p` so small that it keeps nothing (e.g. 1e-300, which is 0 in fp32) keeps the most likely token.
Non-finite values (NaN, inf) are refused by `SamplingParams.validate`.

Row isolation: a row whose logits are not finite (NaN or +inf from the model) or whose sampling raises gets the
token `FAILED` (-1); the other rows are unaffected. The sampled-row path never hands `multinomial` an invalid
distribution (which on CUDA is a device-side assert that would end every request), whatever the logits.

Row maxima computed with the logits: a compiled decode step returns its logits' row maxima and their indices too
(`attach_maxima`), which `sample` takes for greedy rows alone instead of reducing the logits again (~20 us of a
batch-1 step). They ride on that logits tensor only: a new tensor (a row subset, a controlled copy) has none, and
whoever changes it in place (the grammar's masks) drops them (`drop_maxima`).

Legend: n sequences sampled this step, V vocab.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import torch

from flashnext.errors import InputError
from flashnext.logprobs import temperature_logprobs

log = logging.getLogger("flashnext.serve")

FAILED = -1
"""Token of a row that could not be sampled (non-finite logits or an error in its sampling)."""
GREEDY_BELOW = torch.finfo(torch.float32).tiny
"""Temperatures below this (the smallest normal fp32 number) sample greedily: the T -> 0 limit."""
_FP32_MAX = torch.finfo(torch.float32).max
LOGPROBS_MODES = ("raw", "processed")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SPECULATIVE_TOKENS = 16


class FieldError(InputError):
    """An invalid request field; `field` names it (an HTTP error body's `param`), the message names the value."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How one request generates.

    Attributes:
        max_tokens: most tokens to generate (>= 1; 0 only with `prompt_logprobs`: score the prompt, generate nothing).
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling (see the module
            doc for tiny and huge values).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all); the most
            likely token is always kept.
        seed: an int64; seeds this request's own generator, so its samples do not depend on the rest of the batch.
            With n > 1, choice i uses `choice_seed(seed, i)` (choice 0: `seed` itself).
        stop_token_ids: ids that end the request (the id is kept in `token_ids`).
        stop: non-empty strings that end the request; the text is cut before the first match (needs a tokenizer).
        ignore_eos: keep generating past the model's EOS id.
        logprobs: None = no log-probs; 0 = the sampled token's; n > 0 = also the top n per position.
        n: completions of the prompt; they share its prefill (the prompt's state is computed once and copied).
        logprobs_mode: "raw" = log-probs of the model's distribution (temperature-free); "processed" = of the
            distribution sampled from, `flashnext.logprobs.temperature_logprobs(logits, temperature)` (what an RL
            trainer recomputes; top-k / top-p truncation is not applied; a greedy request's are the raw ones).
        return_routed_experts: record the routed experts of every token the model runs for this request (prompt
            and generated, `Completion.routed_experts`), for a trainer's router replay.
        prompt_logprobs: None = none; 0 = the log-prob of every prompt token given the ones before it (the first
            has none); n > 0 = also the top n per position (`serve.prompt_logprobs`; the model's distribution).
        num_speculative_tokens: draft tokens the model's MTP head proposes per step for this request, verified in
            one step of the model (0 = off; None = the engine's default). The output distribution is the same
            either way (greedy: the same tokens, up to float rounding of near ties).
        presence_penalty, frequency_penalty: in [-2, 2], subtracted once per generated token seen / per
            occurrence (OpenAI's definition); repetition_penalty: > 0, divides positive and multiplies negative
            logits of tokens in the prompt or output; logit_bias: {token id: [-100, 100]} added to the logits;
            min_tokens: EOS and `stop_token_ids` are blocked until that many tokens are generated (stop strings
            still apply); min_p: in [0, 1], drops tokens less likely than min_p times the most likely one (after
            temperature). See `serve.logit_controls` for the order and exact formulas.

        structured: a `serve.structured.Structured` constraint (JSON schema, regex, choice, grammar, tool calls)
            the output must match (`serve.grammar` masks the logits), or None.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    logprobs_mode: str = "raw"
    return_routed_experts: bool = False
    num_speculative_tokens: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0

    structured: object | None = None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or one below `GREEDY_BELOW` (its limit)."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise `InputError` naming the first bad field and its value."""
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise FieldError(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
                             "prompt_logprobs")
        least = 0 if self.prompt_logprobs is not None else 1  # nothing to generate: only scoring the prompt
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            why = "" if least == 0 else " (0 only when the prompt's log-probs are asked: echo with logprobs)"
            raise FieldError(f"max_tokens must be an integer >= {least}, got {self.max_tokens!r}{why}", "max_tokens")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise FieldError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise FieldError(f"top_k must be an integer >= 0, got {self.top_k!r}", "top_k")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison too
            raise FieldError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise FieldError(f"seed must be an int64 (in [-2**63, 2**63 - 1]), got {self.seed!r}", "seed")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise FieldError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}", "logprobs")
        if not _is_int(self.n) or self.n < 1:
            raise FieldError(f"n must be an integer >= 1, got {self.n!r}", "n")
        if self.logprobs_mode not in LOGPROBS_MODES:
            msg = f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            raise FieldError(msg, "logprobs_mode")
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise FieldError(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}",
                "num_speculative_tokens",
            )
        bad = next((i for i, t in enumerate(self.stop_token_ids) if not _is_int(t)), None)
        if bad is not None:
            raise FieldError(
                f"stop_token_ids[{bad}] must be an integer, got {self.stop_token_ids[bad]!r}", "stop_token_ids"
            )
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise FieldError(f"stop[{i}] must be a non-empty string, got {s!r}", f"stop[{i}]")
            check_text(s, f"stop[{i}]")
        check_controls(self)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def check_text(text: str, name: str) -> int:
    """UTF-8 size of `text` in bytes; `FieldError` naming `name` if it holds an unpaired surrogate (not Unicode)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise FieldError(
            f"{name} contains an unpaired surrogate {text[e.start]!r} at character {e.start}: not valid Unicode", name
        ) from None


def choice_seed(seed: int, index: int) -> int:
    """The int64 seed of choice `index` of a request seeded with `seed` (choice 0: `seed` itself).

    Choices i > 0 get a splitmix64 hash of `(seed, i)`, so choices differ, are reproducible, and the choices of
    nearby seeds do not coincide (as `seed + i` would make them).
    """
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return z - 2**64 if z > INT64_MAX else z


def random_seed() -> int:
    """A fresh int64 seed for a request without one."""
    return random.SystemRandom().randint(INT64_MIN, INT64_MAX)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    with_logprobs: bool = True,
    errors: dict[int, str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row.

    Args:
        logits: [n, V] raw next-token logits; params / generators: one per row.
        with_logprobs: compute the log-probs (False: the second result is None; a step of requests that asked
            for none skips the full-vocabulary log-softmax).
        errors: if given, receives `{row: message}` for rows whose sampling raised.

    Returns:
        tokens int64 [n] (`FAILED` for a row with non-finite logits or a sampling error) and logprobs fp32
        [n, V]: per row as its `logprobs_mode` says (raw: `log_softmax` of the logits, the model's distribution;
        processed: `temperature_logprobs` at the row's temperature, the distribution it was sampled from).
    """
    # max (not argmax): the same one reduction gives the greedy token and, through the maximum, whether the row
    # is usable (NaN propagates into it, +inf is it).
    if with_logprobs or not all(p.greedy for p in params):
        logits = logits.float()
        maxes, tokens = logits.max(-1)
    else:  # greedy rows alone: the max of the logits as they are (taken with them where they carry it)
        maxes, tokens = greedy_of(logits)
    logprobs = mode_logprobs(logits, params) if with_logprobs else None
    failed = []
    for i, p in enumerate(params):
        if p.greedy:
            continue
        try:
            tokens[i] = _sample_row(logits[i], maxes[i], p, generators[i])
        except Exception as e:  # this row's problem, not the batch's
            log.warning("sampling row %d failed: %s: %s", i, type(e).__name__, e)
            failed.append(i)
            if errors is not None:
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
    # on the host: one copy of n floats instead of three tensor ops per step (isfinite, not, masked_fill)
    failed += [i for i, m in enumerate(maxes.tolist()) if not math.isfinite(m)]
    if failed:
        tokens = tokens.clone()  # (not the maxima a logits tensor carries)
        tokens[failed] = FAILED
    return tokens, logprobs


_MAXIMA = "row_maxima"


def attach_maxima(logits: torch.Tensor, maxes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`logits` [n, V] carrying its rows' maxima and their first indices [n], computed with it (module doc)."""
    vars(logits)[_MAXIMA] = (maxes, tokens)
    return logits


def greedy_of(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row maxima, their first indices) of `logits` [n, V]: the ones it carries (`attach_maxima`), else reduced."""
    return vars(logits).get(_MAXIMA) or logits.max(-1)


def drop_maxima(logits: torch.Tensor) -> None:
    """Forget the maxima `logits` carries: it is being changed in place."""
    vars(logits).pop(_MAXIMA, None)


def mode_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 [n, V] log-probs of each row in its request's `logprobs_mode` (one batched op; a raw row divides by 1,
    which is exact, so mixing modes leaves raw rows bitwise unchanged)."""
    temps = [p.temperature if p.logprobs_mode == "processed" and not p.greedy else 1.0 for p in params]
    if all(t == 1.0 for t in temps):
        return temperature_logprobs(logits)
    t = torch.tensor(temps, dtype=torch.float32, device=logits.device)[:, None].clamp_max(_FP32_MAX)
    return temperature_logprobs(logits, t)


def _sample_row(row: torch.Tensor, row_max: torch.Tensor, p: SamplingParams, gen: torch.Generator | None):
    """One token of a non-greedy row [V] (a 1-element tensor). The distribution is valid for any logits: a
    non-finite row (reported FAILED by the caller) becomes uniform here rather than reaching `multinomial`."""
    return torch.multinomial(target_probs(row, row_max, p), 1, generator=gen).squeeze(0)


def target_probs(row: torch.Tensor, row_max: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The weights fp32 [V] a non-greedy row [V] samples from: temperature, then top-k, min-p, top-p (what
    speculative verification accepts drafts against; they sum to 1 unless top-p dropped tokens, so normalise
    before reading one as a probability). `row_max`: the row's maximum (a 0-d tensor)."""
    scaled = (row - row_max).nan_to_num_(nan=0.0) / min(p.temperature, _FP32_MAX)
    if 0 < p.top_k < row.shape[0]:
        kth = torch.topk(row, p.top_k).values[-1]  # on the raw logits: scaling keeps the order
        scaled = scaled.masked_fill(row < kth, float("-inf"))
    if p.min_p > 0:  # p[t] < min_p * p_max, in logit space (the maximum's scaled logit is 0): renormalised after
        scaled = scaled.masked_fill(scaled < math.log(p.min_p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p; the most likely one always stays (a top_p that
        # rounds to 0 in fp32 would otherwise drop every token).
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    return probs


# ---- the logit controls' checks (`serve.logit_controls` applies them) ----
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_controls(p) -> None:
    """`FieldError` naming the first bad control of `SamplingParams` p (ranges as OpenAI / vLLM)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _finite(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise FieldError(f"{name} must be a number in [-2, 2], got {v!r}", name)
    r = p.repetition_penalty
    if not _finite(r) or r <= 0:
        raise FieldError(f"repetition_penalty must be a finite number > 0, got {r!r}", "repetition_penalty")
    if not _finite(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise FieldError(f"min_p must be a number in [0, 1], got {p.min_p!r}", "min_p")
    if not _is_int(p.min_tokens) or p.min_tokens < 0:
        raise FieldError(f"min_tokens must be an integer >= 0, got {p.min_tokens!r}", "min_tokens")
    if _is_int(p.max_tokens) and p.min_tokens > p.max_tokens:
        raise FieldError(f"min_tokens={p.min_tokens} is more than max_tokens={p.max_tokens}", "min_tokens")
    if p.logit_bias is None:
        return
    if not isinstance(p.logit_bias, dict):
        raise FieldError(f"logit_bias must map token ids to numbers, got {p.logit_bias!r}", "logit_bias")
    for t, b in p.logit_bias.items():
        if not _is_int(t) or t < 0:
            raise FieldError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}", "logit_bias")
        if not _finite(b) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise FieldError(f"logit_bias[{t}] must be a number in [-100, 100], got {b!r}", "logit_bias")


def check_token_ids(p, vocab: int) -> None:
    """`FieldError` for a `logit_bias` token id outside the vocabulary [0, vocab)."""
    bad = sorted(t for t in (p.logit_bias or {}) if t >= vocab)
    if bad:
        raise FieldError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})", "logit_bias")
