"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seeds).

Legend: n sequences sampled this step, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashnext.errors import InputError


@dataclass
class SamplingParams:
    """How one request generates.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (argmax); otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = all).
        seed: seeds this request's own generator, so its samples do not depend on the rest of the batch.
        stop_token_ids: ids that end the request (the id is kept in `token_ids`).
        stop: strings that end the request; the text is cut before the first match (needs a tokenizer).
        ignore_eos: keep generating past the model's EOS id.
        logprobs: None = no log-probs; 0 = the sampled token's; n > 0 = also the top n per position.
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

    def validate(self) -> None:
        """Raise `InputError` naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be in [0, 20], got {self.logprobs}")


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    with_logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one token per row.

    Args:
        logits: [n, V] raw next-token logits; params / generators: one per row.
        with_logprobs: compute the log-probs (False: the second result is None; a step of requests that asked
            for none skips the full-vocabulary log-softmax).

    Returns:
        tokens int64 [n] and logprobs fp32 [n, V] (log-softmax of the raw logits: the model's distribution,
        which is what a trainer's `token_logprobs` computes for the same position).
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1) if with_logprobs else None
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # Keep a token while the mass before it is below top_p (the most likely token always stays).
            drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= p.top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i]).squeeze(0)
    return tokens, logprobs
