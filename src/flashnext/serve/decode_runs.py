"""Decode runs: several greedy decode steps in one engine step, the host's per-step work paid once per run.

A decode step of the compiled graph at batch 1 of `benchmarks/vs_llamacpp.py`'s config takes ~2.0 ms; the engine's
work around it (scheduling, the layout check, sampling, recording, notifying) ~0.5 ms more, most of it cache
misses: the step has just streamed the weights through the cache. When every running request decodes greedily
with nothing that needs the host between its tokens, `Engine(decode_run=K)` runs up to K decode steps in a row
(`DecodeGraph.run_greedy`): each step's greedy tokens (the row maxima the graph returns with its logits) are fed
to the next on the host, then the engine records each step's tokens in order as if it had stepped K times
(`advance`: the scheduler's counts, `Outcomes.emit`'s stop checks and client updates), and samples the last
step's logits as usual. The tokens are the ones K single steps give (the same graph, the same inputs, the same
greedy choice); a request that stops within a run (EOS, a stop token or string) had its later steps computed
and dropped (its slot is freed after). Runs never pass a request's `max_tokens` or `max_model_len`.

A run needs: decode-only steps the graph runs (`decode_only`: no MRoPE, speculation or routing record), every
request greedy with no log-probs, no logit controls (penalties, bias, `min_tokens`), no grammar, not a suspect
of a failed step, and no request waiting for a slot (a run delays its admission); `Engine` adds: no automatic
speculation (it times single steps). The price: a run's tokens reach the clients together at its end, and a
request arriving meanwhile waits for the run (K steps).
"""

from __future__ import annotations

from flashnext.errors import ConfigError
from flashnext.serve.decode_graph import decode_only
from flashnext.serve.logit_controls import controlled


def checked(decode_run, decode_graph: bool) -> int:
    """`Engine(decode_run=)` checked: an integer >= 1, above 1 only with the decode graph (runs are its steps)."""
    if not isinstance(decode_run, int) or decode_run < 1 or (decode_run > 1 and not decode_graph):
        raise ConfigError(f"decode_run must be an integer >= 1 (decode steps per engine step; runs are steps of the "
                          f"decode graph: > 1 needs decode_graph=True), got {decode_run!r}")  # fmt: skip
    return decode_run


def forward(engine, plan) -> tuple:
    """The engine's model step over `plan` (`ModelStep`'s result), as a decode run where one applies
    (`run_length`): its early steps recorded (`advance`), its last step's logits returned to be sampled."""
    steps = run_length(engine, plan)
    if steps == 1:
        return engine.model_step(plan)
    early, logits = engine.model_step.greedy_run(plan, steps)
    for tokens in early:
        advance(engine, plan, tokens)
    return logits, None, None


def run_length(engine, plan) -> int:
    """Decode steps to run for `plan` [(request, tokens)]: up to `engine.decode_run` when a run may take it (module
    doc), bounded by each request's tokens left (`max_tokens`, `max_model_len`); else 1."""
    graph = engine.decode_graph
    if engine.decode_run == 1 or engine.waiting or engine.spec_auto is not None or graph is None:
        return 1
    if not decode_only(plan) or not all(_greedy(req) for req, _ in plan):
        return 1
    left = min(min(r.params.max_tokens - len(r.output_ids), engine.max_model_len - r.num_tokens) for r, _ in plan)
    steps = min(engine.decode_run, left)
    return steps if steps > 1 and graph.ready_for(len(plan)) else 1


def _greedy(req) -> bool:
    p = req.params
    return p.greedy and p.logprobs is None and not controlled(p) and req.constraint is None and not req.suspect


def advance(engine, plan, tokens: list[int]) -> None:
    """Record one early step of a decode run: each entry fed its token (`Scheduler.advance`) and given its greedy
    token `tokens[i]` (`Outcomes.emit`: stop checks, client updates); entries finished earlier in the run are
    skipped, as a later single step would not have run them."""
    fed = engine.scheduler.advance(plan, None)
    for req, row in zip(fed.to_sample, fed.rows, strict=True):
        engine.outcomes.emit(req, [tokens[row]], None, None, [0])
    engine.stats.step(0, 0.0, len(fed.to_sample))
