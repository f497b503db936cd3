"""A request's way in: its prompt encoded and checked, its images' MRoPE positions, its n choices built.

`Intake.request` (what `Engine.add_request` calls) checks a request against the engine's limits and builds the
parent of its choices, for the scheduler to queue. Every check raises `InputError` (a `FieldError` naming the
client's field where there is one) before anything is queued.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from flashnext.errors import ConfigError, InputError
from flashnext.model.multimodal import get_rope_index
from flashnext.serve import grammar, structured
from flashnext.serve.loading import max_token_bytes
from flashnext.serve.request import Request
from flashnext.serve.sampling import (
    MAX_SPECULATIVE_TOKENS,
    FieldError,
    SamplingParams,
    check_text,
    check_token_ids,
    choice_seed,
    random_seed,
)
from flashnext.serve.spec_auto import K_MAX, is_auto

__all__ = ["NO_MTP", "Intake", "check_prompt", "check_speculative", "encode_prompt", "image_positions", "make_choices"]

NO_MTP = "this model has no MTP draft head (mtp.* weights with mtp_num_hidden_layers in its config.json)"


class Intake:
    """Checks new requests against `Engine`'s limits and builds them (see `Engine.add_request`).

    `speculative_default`: draft tokens of a request that does not set its own; `can_speculate`: the model has
    an MTP head. A text prompt longer than `max_prompt_bytes` cannot fit in `max_model_len` tokens: refused
    before tokenizing (None without a tokenizer)."""

    def __init__(self, model, tokenizer, max_slots: int, max_model_len: int, speculative_default: int, can_speculate):
        self.model = model
        self.tokenizer = tokenizer
        self.max_slots = max_slots
        self.max_model_len = max_model_len
        self.speculative_default = speculative_default
        self.can_speculate = can_speculate
        self.device = next(model.parameters()).device
        per_token = max_token_bytes(tokenizer) if tokenizer is not None else None
        self.max_prompt_bytes = per_token * max_model_len if per_token is not None else None
        self._ids = itertools.count()
        self._grammars: grammar.Grammars | None = None
        self._grammars_lock = threading.Lock()  # requests are built on the HTTP handlers' worker threads

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt ids (`encode_prompt`)."""
        return encode_prompt(prompt, self.tokenizer, self.max_prompt_bytes, self.max_model_len)

    def request(
        self, prompt, params: SamplingParams | None, request_id, on_update, pixel_values, image_grid_thw, group,
        length_field,
    ) -> Request:  # fmt: skip
        """The checked request's parent choice (the arguments are `Engine.add_request`'s)."""
        params = params or SamplingParams()
        params.validate()
        if params.n > self.max_slots:
            raise FieldError(f"n={params.n} exceeds max_slots={self.max_slots} (the choices run at once)", "n")
        ids = self.encode(prompt)
        check_prompt(ids, params, self.max_model_len, self.model.config.vocab_size, length_field)
        check_token_ids(params, self.model.config.vocab_size)  # logit_bias ids
        if params.stop and self.tokenizer is None:
            raise InputError("stop strings need a tokenizer")
        spec_k = self.speculative_default if params.num_speculative_tokens is None else params.num_speculative_tokens
        if spec_k and not self.can_speculate:
            raise FieldError(f"num_speculative_tokens={spec_k}: {NO_MTP}", "num_speculative_tokens")
        if params.return_routed_experts:  # drafts' experts would need trimming on rejection; same tokens without them
            spec_k = 0
        mrope = None
        if pixel_values is not None or image_grid_thw is not None:
            mrope = image_positions(self.model, ids, pixel_values, image_grid_thw)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        images = (pixel_values, image_grid_thw) if mrope is not None else None
        parent = make_choices(rid, ids, params, self.device, on_update, group, mrope, images, spec_k)
        if params.structured is not None:
            structured.attach(parent, ids, self.grammars(), self.tokenizer)
        return parent

    def grammars(self) -> grammar.Grammars:
        """The engine's grammar compiler (`serve.grammar`), made on the first structured request."""
        with self._grammars_lock:
            if self._grammars is None:
                eos = getattr(self.tokenizer, "eos_token_id", None)
                eos = eos if eos is not None else self.model.config.eos_id
                self._grammars = grammar.Grammars(self.tokenizer, self.model.config.vocab_size, eos)
            return self._grammars


def check_speculative(k, model) -> int:
    """The engine's default draft tokens `k`, checked: an integer in [0, MAX_SPECULATIVE_TOKENS], 0 for a
    model without an MTP head; "auto" (`serve.spec_auto`) is its longest draft, 0 without a head. Raises
    `ConfigError`."""
    if is_auto(k):
        return K_MAX if model.mtp is not None else 0
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(
            f'num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r} (or "auto")'
        )
    if k and model.mtp is None:
        raise ConfigError(f"num_speculative_tokens={k} needs a model with an MTP head: {NO_MTP}")
    return k


def encode_prompt(
    prompt: str | Sequence[int], tokenizer, max_prompt_bytes: int | None, max_model_len: int
) -> list[int]:
    """Prompt ids; a text prompt is checked (valid Unicode, not longer than `max_prompt_bytes`, a size no
    `max_model_len` tokens can hold) before tokenizing."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InputError("text prompts need a tokenizer; pass token ids")
        size = check_text(prompt, "prompt")
        if max_prompt_bytes is not None and size > max_prompt_bytes:
            raise FieldError(
                f"prompt is {size} bytes, more than max_model_len={max_model_len} tokens can hold (a "
                f"token covers at most {max_prompt_bytes // max_model_len} bytes); not tokenized",
                "prompt",
            )
        return list(tokenizer.encode(prompt))
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise FieldError("a prompt is a string or a sequence of token ids (ints)", "prompt") from None


def check_prompt(
    ids: list[int], params: SamplingParams, max_model_len: int, vocab: int, length_field: str | None
) -> None:
    """Refuse an empty prompt, one that leaves no room in `max_model_len`, one whose `max_tokens` does not fit
    when the client named that field (`length_field`), and ids outside the vocabulary."""
    if not ids:
        raise FieldError("prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        msg = f"prompt has {len(ids)} tokens; max_model_len={max_model_len} leaves no room"
        raise FieldError(msg, "prompt")
    if length_field is not None and len(ids) + params.max_tokens > max_model_len:
        raise FieldError(
            f"{length_field}={params.max_tokens} plus the prompt's {len(ids)} tokens is "
            f"{len(ids) + params.max_tokens}, more than this model's context of {max_model_len} tokens "
            f"(max_model_len); ask for at most {max_model_len - len(ids)}",
            length_field,
        )
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise FieldError(f"prompt token {bad} = {ids[bad]} is outside the vocabulary [0, {vocab})", "prompt")


def image_positions(model, ids: list[int], pixel_values, grid) -> tuple[torch.Tensor, int]:
    """Check a request's images against the model and its placeholders; (MRoPE table [3, L], delta)."""
    visual = model.visual
    if visual is None:
        raise InputError("this model is text-only (no vision tower); it does not accept images")
    if pixel_values is None or grid is None:
        raise InputError("images need both pixel_values and image_grid_thw")
    grid = torch.as_tensor(grid, dtype=torch.long)
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise InputError(f"image_grid_thw must be [n_images, 3], got {tuple(grid.shape)}")
    if pixel_values.shape[0] != int(grid.prod(-1).sum()):
        raise InputError(
            f"pixel_values has {pixel_values.shape[0]} patches; image_grid_thw gives {int(grid.prod(-1).sum())}"
        )
    ids_t = torch.tensor(ids, dtype=torch.long)
    image_token_id = model.image_token_id
    m = visual.config.spatial_merge_size
    n_placeholders = int((ids_t == image_token_id).sum())
    n_features = int(grid.prod(-1).sum()) // (m * m)
    if n_placeholders != n_features:
        raise InputError(
            f"the prompt has {n_placeholders} image placeholders (id {image_token_id}) but the images give "
            f"{n_features} features"
        )
    positions, deltas = get_rope_index(ids_t, [0, len(ids)], (ids_t == image_token_id).long(), grid, m)
    return positions, int(deltas[0])


def make_choices(
    rid: str,
    ids: list[int],
    params: SamplingParams,
    device,
    on_update: Callable[[Request], None] | None,
    group: str | None,
    mrope,
    images,
    spec_k: int,
) -> Request:
    """The parent request (choice 0) of `params.n` choices of one prompt, each with its own seeded generator;
    the children (`<rid>/<i>`) are its `forks` until its prompt is prefilled. Asked prompt log-probs are one
    table shared by all choices."""
    seed = params.seed if params.seed is not None else random_seed()
    choices = [
        Request(
            rid if i == 0 else f"{rid}/{i}",
            ids,
            params,
            on_update=on_update,
            index=i,
            group=group or rid,
            generator=torch.Generator(device=device).manual_seed(choice_seed(seed, i)),
            mrope=mrope,
            images=images,
            spec_k=spec_k,
        )  # fmt: skip
        for i in range(params.n)
    ]
    if params.prompt_logprobs is not None:  # one table for all choices: they share the prompt
        table, tops = [None] * len(ids), [[] for _ in ids]
        for choice in choices:
            choice.prompt_logprobs, choice.prompt_top_logprobs = table, tops
    parent = choices[0]
    parent.choices, parent.forks = choices, choices[1:]
    return parent
