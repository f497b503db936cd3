"""Speculative-decoding test helpers: a small model with an MTP head, known drafts, a mixed run, a comparison.

Imported by module name (`from spec_helpers import ...`): pytest puts this test folder on `sys.path`.
"""

from __future__ import annotations

import torch
from serve_helpers import small_model

from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

TIE = 1e-4  # a greedy divergence is allowed only where the plain run's top-2 logits are this close


def spec_model(cfg: dict, seed: int = 0):
    """The shared small config with one MTP layer, every weight perturbed (see `serve_helpers.small_model`)."""
    return small_model({**cfg, "mtp_num_hidden_layers": 1}, seed)


class KnownDrafts:
    """Replaces an engine's draft chain (`Speculator._draft`) with tokens of a known continuation (the plain
    run's), each replaced by a wrong one with probability `p_wrong` (seeded): every pattern of full, partial and
    no acceptance occurs, where the random head's drafts would almost all be rejected. The head's cells are still
    fed by the real `propose`; only the draft tokens come from here."""

    def __init__(self, engine: Engine, truth: dict[tuple, list[int]], p_wrong: float, seed: int = 0):
        self.truth, self.p_wrong, self.vocab = truth, p_wrong, engine.config.vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        engine.speculator._draft = self

    def __call__(self, reqs, want, logits, r_last) -> None:
        for req, w in zip(reqs, want, strict=True):
            known = self.truth.get(tuple(req.prompt_ids), [])[len(req.output_ids) :][:w]
            drafts = known + [0] * (w - len(known))
            wrong = (torch.rand(w, generator=self.gen) < self.p_wrong).tolist()
            req.drafts = [(t + 1) % self.vocab if bad else t for t, bad in zip(drafts, wrong, strict=True)]


def run_mixed(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], waves: list[int]):
    """Add prompts in waves (wave i joins at step `waves[i]`, the prompts dealt round-robin over the waves), step
    to the end; returns the requests in prompt order. Requests leave as they finish (their own max_tokens)."""
    joins = {}
    for i in range(len(prompts)):
        joins.setdefault(waves[i % len(waves)], []).append(i)
    reqs: dict[int, object] = {}
    for step in range(100_000):
        for i in joins.pop(step, []):
            reqs[i] = engine.add_request(prompts[i], params[i])
        if not joins and not engine.has_unfinished():
            break
        engine.step()
    assert engine.cache.free_slots == engine.cache.max_slots
    return [reqs[i] for i in range(len(prompts))]


def compare_greedy(plain, spec) -> list[tuple[int, int, float]]:
    """Each speculative request's tokens against the plain run's (which asked for top-2 log-probs).

    Returns the (request, position, top-2 gap) of every divergence at a near tie (the rest of that request is not
    compared: its context differs from there on); raises AssertionError for any other divergence.
    """
    ties = []
    for r, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert a.finish_reason == b.finish_reason == "length", (r, a.finish_reason, b.finish_reason, b.error)
        at = next((j for j, (x, y) in enumerate(zip(a.output_ids, b.output_ids, strict=True)) if x != y), None)
        if at is None:
            assert a.output_ids == b.output_ids
            continue
        (t1, l1), (_, l2) = a.top_logprobs[at][:2]
        gap = l1 - l2
        assert gap <= TIE, f"request {r} diverges at token {at} ({t1} vs {b.output_ids[at]}), top-2 gap {gap:.3g}"
        ties.append((r, at, gap))
    return ties


def full_forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The target's log-probs of `output` after `prompt`, from one plain forward (no serving state), fp32 [n]."""
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[at, torch.tensor(output)]
