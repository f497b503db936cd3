"""A request's scheduling and output state (`Request`, owned by the engine thread) and its result (`Completion`).

A request with `n` choices is a group: the parent (choice 0, the id given to `add_request`) and n-1 children
(`<id>/<i>`), all listed in the parent's `choices`. The children hold cache slots from admission but wait in the
parent's `forks` until its prompt is prefilled; then the parent's slot state is copied into theirs and every
choice samples its first token from the same logits (the prompt is computed once).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashnext.serve.sampling import SamplingParams

FINISH_REASONS = ("length", "stop", "abort", "error")


@dataclass
class Completion:
    """The result of one request (one choice of it).

    Attributes:
        token_ids: generated ids (a stop id or EOS that ended the request included).
        text: decoded text (None without a tokenizer); cut before a matched stop string.
        logprobs: log-prob of each generated token under the model (None unless requested).
        top_logprobs: per position, the top n `(token_id, logprob)` pairs (None unless n > 0).
        finish_reason: "length", "stop", "abort" (cancelled) or "error" (failed; `error` says why).
        index: the choice's index among the request's n.
        error: why the request failed (finish_reason "error" or "abort"), else None.
        routed_experts: uint16 [tokens run, L, k]: the experts of every token the model ran for this request, in
            order (the prompt, then each generated token but the last, which ended the request before it was fed
            back); None unless `return_routed_experts` was asked.
        weight_version: the engine's weight version when the request was admitted (weight updates wait for
            running requests to finish, so every token of a request comes from that version).
        num_draft_tokens: MTP draft tokens verified for this choice (speculative decoding; 0 without).
        num_accepted_tokens: of those, accepted.
        num_verify_steps: steps that verified drafts (each emits the accepted drafts plus one token).
        prompt_logprobs: per prompt position, the log-prob of its token given the ones before (None at position 0);
            None unless `SamplingParams.prompt_logprobs` was asked (`serve.prompt_logprobs`).
        prompt_top_logprobs: per prompt position, the top n `(token_id, logprob)` pairs ([] at position 0); None
            unless `prompt_logprobs` > 0.
        cached_tokens: prompt tokens resumed from the prefix cache instead of prefilled (`serve.prefix_cache`).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    index: int = 0
    error: str | None = None
    routed_experts: torch.Tensor | None = None
    weight_version: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0


@dataclass(eq=False)  # identity: requests are compared as objects (membership in the queues)
class Request:
    """A request's scheduling and output state (owned by the engine thread).

    `num_cached` counts the known tokens (prompt, then generated ones) whose state is in the slot; after a failed
    step the slot is reset and `num_cached` restarts at 0, so the request is recomputed from its token history
    (`suspect` until that recompute succeeds). Speculative decoding (`spec_k` > 0, see `serve.speculative`): the
    request's next step also feeds `drafts`; `mtp_cells` counts the positions whose MTP-head cell is in its slot.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Request], None] | None = None
    generator: torch.Generator | None = None
    index: int = 0  # choice index within the group
    group: str = ""  # the parent's request id (what `Engine.abort` matches)
    choices: list[Request] = field(default_factory=list)  # the group's choices, on the parent
    forks: list[Request] = field(default_factory=list)  # children waiting for the parent's prefill
    slot: int | None = None
    num_cached: int = 0  # tokens whose state is in the cache
    suspect: bool = False  # in a failed step; recomputed alone until it passes or fails on its own
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    images: tuple[torch.Tensor, torch.Tensor] | None = None  # (pixel_values, image_grid_thw) until finished
    prompt_embeds: torch.Tensor | None = None  # [L, D] text + image features, while prefilling
    mrope: tuple[torch.Tensor, int] | None = None  # prompt MRoPE positions int64 [3, L] and the decode delta
    routed: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, uint16 [n, L, k])
    weight_version: int = 0  # the engine's weights when admitted
    spec_k: int = 0  # draft tokens per step (0: no speculation)
    drafts: list[int] = field(default_factory=list)  # proposed tokens after the last known one, to verify next
    mtp_cells: int = 0  # positions whose MTP-head cell is cached (cells 0 .. mtp_cells - 1)
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    prompt_logprobs: list[float | None] | None = None  # per prompt position (shared by the choices), when asked
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_prompt: int = 0  # prompt tokens resumed from the prefix cache (`serve.prefix_cache`)
    resume_residual: torch.Tensor | None = None  # a prefix-cache hit's residual, to recompute its last MTP cell

    constraint: object | None = None  # `serve.grammar.Constraint` of a structured-output request (per choice)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, stop: int) -> list[int]:
        """The known tokens at positions start .. stop - 1 (prompt, then generated)."""
        p = len(self.prompt_ids)
        prompt = self.prompt_ids[start:stop] if start < p else []
        return prompt + self.output_ids[max(0, start - p) : max(0, stop - p)]

    def pending_ids(self, n: int) -> list[int]:
        """The next n known tokens to feed: prompt tokens, then generated ones (a decode feeds the last one)."""
        start, p = self.num_cached, len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - p) : start + n - p]

    def completion(self, with_text: bool) -> Completion:
        want = self.params.logprobs is not None
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt_ids),
            token_ids=list(self.output_ids),
            text=self.text if with_text else None,
            logprobs=list(self.logprobs) if want else None,
            top_logprobs=[list(t) for t in self.top_logprobs] if want and self.params.logprobs else None,
            finish_reason=self.finish_reason,
            index=self.index,
            error=self.error,
            routed_experts=self.routed_experts() if self.params.return_routed_experts else None,
            weight_version=self.weight_version,
            num_draft_tokens=self.num_drafted,
            num_accepted_tokens=self.num_accepted,
            num_verify_steps=self.num_verify_steps,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            prompt_top_logprobs=[list(t) for t in self.prompt_top_logprobs]
            if self.prompt_top_logprobs is not None and self.params.prompt_logprobs
            else None,
            cached_tokens=self.num_cached_prompt,
        )

    def record_routing(self, rows: torch.Tensor) -> None:
        """Keep the experts [n, L, k] of the n tokens about to be counted as cached (from `num_cached` on)."""
        self.routed.append((self.num_cached, rows.to(torch.uint16)))

    def routed_experts(self) -> torch.Tensor | None:
        """uint16 [tokens run, L, k] in position order; a recomputed position keeps its latest rows."""
        if not self.routed:
            return None
        n = max(start + rows.shape[0] for start, rows in self.routed)
        out = self.routed[0][1].new_empty((n, *self.routed[0][1].shape[1:]))
        for start, rows in self.routed:
            out[start : start + rows.shape[0]] = rows
        return out
