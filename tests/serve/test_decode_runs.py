"""Decode runs (`serve.decode_runs`, `Engine(decode_run=K)`): several greedy decode-graph steps per engine step give
the tokens single steps give, stop where single steps stop, step aside for requests that need the host between
tokens, and lose nothing when a step of a run fails.

The graphs run with the "eager" backend (dynamo traces the static step, no code generation). A run feeds the graph
the inputs single steps feed it, except after a request stops inside a run: its row is still computed until the run
ends, so the others keep the bucket they had where single steps would take a smaller one (each row's products are
its own, equal to rounding across buckets). Tokens are compared exactly: greedy over these seeded prompts meets no
near tie (a tie broken the other way by rounding would show as a different token, not as a wrong path).
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import small_model

from flashnext.errors import ConfigError
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams, attach_maxima

KW = dict(max_slots=4, max_model_len=40, max_num_batched_tokens=16, decode_graph=True, decode_buckets=[1, 2, 4],
          compile_backend="eager")  # fmt: skip


@pytest.fixture(scope="module")
def model(small_config_module):
    cfg = {**small_config_module, "num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"],
           "ple_layer_ids": [1]}  # fmt: skip
    return small_model(cfg)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (3 + 2 * i,), generator=gen).tolist() for i in range(n)]


def _generate(model, prompts, params, run: int, **kw):
    """(completions, engine steps taken, decode steps the graph ran) of an engine with `decode_run=run`."""
    engine = Engine(model, **{**KW, **kw}, decode_run=run)
    graph_steps, inner = [0], engine.decode_graph._run

    def counted(*args):
        graph_steps[0] += 1
        return inner(*args)

    engine.decode_graph._run = counted
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return [r.completion(False) for r in reqs], steps, graph_steps[0]


def _same(got, want):
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]


def test_runs_give_the_tokens_of_single_steps(model):
    """Three greedy requests of different lengths (one bounded by `max_model_len`): runs of up to 6 steps give the
    tokens and finish reasons of single steps, in fewer engine steps but as many graph steps (a run never passes
    the request with the fewest tokens left, so none is computed past its end)."""
    prompts = _prompts(3, 0)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (17, 9, 40)]
    want, want_steps, want_graph = _generate(model, prompts, params, run=1)
    got, steps, graph = _generate(model, prompts, params, run=6)
    _same(got, want)
    assert want[2].finish_reason == "length" and len(want[2].token_ids) == 40 - len(prompts[2])
    assert steps < want_steps - 10 and graph == want_graph


def test_a_request_stopping_inside_a_run_stops_at_its_token(model):
    """A stop token met in the middle of a run ends that request there (its later steps are dropped), the other
    request goes on: both as single steps give them."""
    prompts = _prompts(2, 3)
    free = _generate(model, prompts, [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 2, run=1)
    stop = free[0][0].token_ids[6]  # the 7th token of the first request: inside its second run of 4
    first = free[0][0].token_ids.index(stop)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]  # fmt: skip
    want = _generate(model, prompts, params, run=1)[0]
    got = _generate(model, prompts, params, run=4)[0]
    _same(got, want)
    assert got[0].finish_reason == "stop" and got[0].token_ids == free[0][0].token_ids[: first + 1]
    assert len(got[1].token_ids) == 20


@pytest.mark.parametrize(
    "other",
    [
        dict(temperature=0.8, seed=3),  # sampled
        dict(temperature=0.0, logprobs=2),  # log-probs asked
        dict(temperature=0.0, repetition_penalty=1.3),  # a logit control
    ],
)
def test_a_request_needing_the_host_between_tokens_keeps_single_steps(model, other):
    """One request that needs the host after each token (sampled, log-probs, penalties) beside a greedy one: no
    run (as many engine steps as graph steps) and the same tokens as without runs."""
    prompts = _prompts(2, 5)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **other),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]  # fmt: skip
    want = _generate(model, prompts, params, run=1)[0]
    got, steps, graph = _generate(model, prompts, params, run=8)
    _same(got, want)
    assert graph == steps - 1  # every engine step but the one prefilling both prompts ran one graph step


def test_no_run_while_a_request_waits_for_a_slot(model):
    """Three requests on two slots: while the third waits, steps stay single (a run would delay its admission);
    once it runs alone with the others done, runs resume. Tokens as single steps give them."""
    prompts = _prompts(3, 7)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 8, 14)]
    want = _generate(model, prompts, params, run=1, max_slots=2)[0]
    engine = Engine(model, **{**KW, "max_slots": 2}, decode_run=5)
    lengths, inner = [], engine.model_step.greedy_run

    def spy(plan, steps):
        lengths.append((len(engine.waiting), steps))
        return inner(plan, steps)

    engine.model_step.greedy_run = spy
    _same(engine.generate(prompts, params), want)
    assert lengths and all(waiting == 0 for waiting, _ in lengths)
    assert max(steps for _, steps in lengths) == 5


def test_a_run_ends_early_at_non_finite_logits(model):
    """`DecodeGraph.run_greedy`: each step is fed the greedy tokens of the one before at the next position; a step
    whose maxima are not finite ends the run and comes back as its last logits."""
    engine = Engine(model, **KW)
    graph, calls = engine.decode_graph, []

    def fake(ids, slots, cached):
        calls.append((list(ids), list(cached)))
        logits = torch.zeros(2, 8)
        logits[:, len(calls)] = 1.0
        if len(calls) == 3:
            logits[1, 0] = float("nan")
        return attach_maxima(logits, *logits.max(-1)) if len(calls) != 3 else attach_maxima(
            logits, torch.tensor([1.0, float("nan")]), torch.tensor([3, 0]))  # fmt: skip

    graph._run = fake
    tokens, last = graph.run_greedy([5, 6], [0, 1], [10, 4], steps=6)
    assert tokens == [[1, 1], [2, 2]]
    assert calls == [([5, 6], [10, 4]), ([1, 1], [11, 5]), ([2, 2], [12, 6])]
    assert last[0, 3] == 1.0
    tokens, _ = graph.run_greedy([5, 6], [0, 1], [10, 4], steps=1)
    assert tokens == []


def test_a_failed_step_inside_a_run_loses_nothing(model):
    """The third graph step of the first run raises: the requests of the run are recomputed (as after any failed
    step, `Engine`'s module doc) and end with the tokens of an undisturbed engine."""
    prompts = _prompts(2, 9)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 2
    want = _generate(model, prompts, params, run=1)[0]
    engine = Engine(model, **KW, decode_run=4)
    inner, count = engine.decode_graph._run, [0]

    def flaky(*args):
        count[0] += 1
        if count[0] == 3:
            raise RuntimeError("injected")
        return inner(*args)

    engine.decode_graph._run = flaky
    got = engine.generate(prompts, params)
    _same(got, want)
    assert engine.stats.failed_steps == 1 and count[0] > 3


def test_decode_run_below_one_or_without_the_graph_is_refused(model):
    with pytest.raises(ConfigError, match="decode_run must be an integer >= 1.*got 0"):
        Engine(model, **KW, decode_run=0)
    with pytest.raises(ConfigError, match="needs decode_graph=True.*got 4"):
        Engine(model, max_slots=2, max_model_len=40, decode_run=4)
