"""Prompt log-probs (`SamplingParams.prompt_logprobs`): what a client's `echo` + `logprobs` asks for, and what
lm-eval's loglikelihood and multiple-choice tasks are computed from.

The log-prob of prompt token p is read from the logits at position p - 1 (the first prompt token has none: None).
A prefill chunk of positions [c, c + n) holds those logits for tokens c + 1 .. c + n, so the step that feeds the
chunk asks the model for the rows of its positions below the prompt's last one (the last position's row predicts
the first generated token: it is the row the engine samples from anyway) next to the usual last-token rows
(`forward_step(rows=...)`), and records them as they come. A chunked prompt fills its table chunk by chunk; a
recomputed prompt (after a failed step) overwrites the same positions with the same values. The n choices of a
request share one table (they share the prompt).

Log-probs are of the model's distribution (`log_softmax` of the logits in fp32, temperature-free), as OpenAI's
and vLLM's echoed prompt log-probs; the top-n alternatives are ranked by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashnext.serve.request import Request


@dataclass
class PromptRows:
    """The prompt positions a step's stream carries logits for: entry `req` asks for positions
    `first .. first + count - 1`, at stream rows `row .. row + count - 1`."""

    req: Request
    first: int
    row: int
    count: int


def prompt_rows(plan: list[tuple[Request, int]], cu: list[int]) -> list[PromptRows]:
    """The entries of a step (the engine's plan, `cu` its stream offsets) whose prompt log-probs it computes."""
    out = []
    for i, (req, n) in enumerate(plan):
        if req.prompt_logprobs is None:
            continue
        start, stop = req.num_cached, min(req.num_cached + n, len(req.prompt_ids) - 1)
        if stop > start:
            out.append(PromptRows(req, start, cu[i], stop - start))
    return out


def stream_rows(entries: list[PromptRows]) -> list[int]:
    """The stream rows of `entries`, in order (what `forward_step(rows=...)` is asked for after the usual rows)."""
    return [e.row + j for e in entries for j in range(e.count)]


def record(entries: list[PromptRows], logits: torch.Tensor) -> list[tuple[Request, str]]:
    """Fill the entries' prompt log-prob tables from `logits` [sum of counts, V] (`stream_rows` order). Returns the
    requests whose logits at a scored position are not finite, with why (the engine ends them: a NaN is no score)."""
    if not entries:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(
        [e.req.prompt_ids[e.first + 1 + j] for e in entries for j in range(e.count)], device=logprobs.device
    )
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    top_n = max(e.req.params.prompt_logprobs for e in entries)
    top = torch.topk(logprobs, top_n, dim=-1) if top_n else None
    finite = torch.isfinite(logits).all(-1).tolist()
    failed, at = [], 0
    for e in entries:
        bad = [e.first + j for j in range(e.count) if not finite[at + j]]
        if bad:
            failed.append((e.req, f"the model's logits at prompt position(s) {bad[:8]} are not finite (NaN or inf)"))
            at += e.count
            continue
        n_top = e.req.params.prompt_logprobs
        for j in range(e.count):
            pos = e.first + 1 + j
            e.req.prompt_logprobs[pos] = chosen[at]
            if n_top:
                ids, vals = top.indices[at, :n_top].tolist(), top.values[at, :n_top].tolist()
                e.req.prompt_top_logprobs[pos] = list(zip(ids, vals, strict=True))
            at += 1
    return failed
