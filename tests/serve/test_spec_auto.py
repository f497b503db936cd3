"""Adaptive speculative decoding (`num_speculative_tokens="auto"`, `serve.spec_auto`): the draft-length choice
against its formula, the cost bookkeeping, and the engine's behaviour with drafts that pay and drafts that do not.

Costs are injected (`AutoSpec(fixed=(c, v))`): no timing in these tests. Greedy runs are compared with the plain
run as in test_speculative.py (a divergence only at a near tie, `compare_greedy`).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from spec_helpers import KnownDrafts, compare_greedy, spec_model

from flashnext.errors import ConfigError
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.spec_auto import AutoSpec, bucket, choose_k, expected_tokens, pick_k


# ---- the choice against its formula -----------------------------------------------------------------------------
def _reference_k(a: float, c: float, v: float, k_max: int, min_gain: float) -> int:
    """argmax over k of (1 - a^(k+1)) / (1 - a) / (1 + k (c + v)), the shortest among equals; 0 below min_gain."""

    def gain(k):
        e = k + 1.0 if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        return e / (1.0 + k * (c + v))

    gains = [gain(k) for k in range(k_max + 1)]
    best = max(gains)
    k = next(k for k, g in enumerate(gains) if g >= best - 1e-9)
    return k if gains[k] >= min_gain else 0


@pytest.mark.parametrize("min_gain", [1.0, 1.05])
def test_choose_k_is_the_formulas_argmax(min_gain):
    grid = itertools.product([0.0, 0.05, 0.2, 0.4, 0.55, 0.7, 0.85, 0.95, 1.0], [0.0, 0.02, 0.1, 0.3, 0.6, 1.2],
                             [0.0, 0.01, 0.1, 0.5], [0, 1, 3, 4, 8])  # fmt: skip
    for a, c, v, k_max in grid:
        assert choose_k(a, c, v, k_max, min_gain) == _reference_k(a, c, v, k_max, min_gain), (a, c, v, k_max)


def test_choose_k_reads_as_expected():
    """Worked cases: a free draft with certain acceptance takes the longest; a draft as dear as a step never pays
    below certain acceptance; no acceptance, no draft; a big batch's verify cost turns drafting off."""
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert choose_k(1.0, 0.0, 0.0, 4) == 4
    assert choose_k(0.9, 1.0, 0.0, 4) == 0  # gain(1) = 1.9 / 2 < 1
    assert choose_k(0.0, 0.01, 0.0, 4) == 0
    assert choose_k(0.7, 0.05, 0.0, 4) >= 3
    assert choose_k(0.7, 0.05, 16 * 0.05, 4) == 0  # (1 + 0.7) / (1 + 0.85) < 1


def test_costs_from_step_times():
    """Steps t = t0 + m x (x extra tokens) and draft steps of t_d give c = t_d / t0, v = B m / t0; an unmeasured
    bucket falls back to the priors; acceptance is an exponential average seeded from the engine's rate."""
    auto = AutoSpec(prior_c=0.3, prior_v=0.02)
    assert auto.model.costs(4) == (0.3, 0.08)
    for x in (0, 4, 8, 0, 12):
        auto.model.record_step(4, x, 0.010 + 0.0005 * x)
    auto.model.record_drafts(4, 2, 0.004)
    c, v = auto.model.costs(3)  # bucket 4
    assert bucket(3) == bucket(4) == 4 and bucket(5) == 8 and bucket(1) == 1
    assert c == pytest.approx(0.2, rel=1e-6) and v == pytest.approx(3 * 0.0005 / 0.010, rel=1e-6)
    auto.model.plain[4] = 0.008  # a measured plain step: the speculative steps' overhead (0.002) joins the token cost
    c, v = auto.model.costs(4)
    x, y = auto.model.steps[4].mean()  # (decayed means)
    assert c == pytest.approx(0.25) and v == pytest.approx(4 * (y - 0.008) / x / 0.008)
    assert (y - 0.008) / x > 0.0005  # the average cost per token, overhead included, above the line's slope
    req = object.__new__(type("R", (), {}))
    auto.observe(req, 3, 1)  # position 1 accepted, position 2 rejected, position 3 not tried
    assert auto.rates[req] == pytest.approx([0.5 + 0.15 * 0.5, 0.5 - 0.15 * 0.5, 0.5, 0.5])
    assert auto.rate == pytest.approx([0.5 + 0.02 * 0.5, 0.5 - 0.02 * 0.5, 0.5, 0.5])


def test_acceptance_is_kept_per_draft_position():
    """A head whose first draft is always right and whose later drafts are always wrong: the per-position rates
    learn exactly that (E(k) = 2 for every k >= 1), so the choice is k = 1, where one pooled rate (~0.5 from one
    success and one failure per step) would buy a second draft that never pays."""
    auto = AutoSpec(fixed=(0.1, 0.02))
    req = object.__new__(type("R", (), {}))
    for _ in range(60):
        auto.observe(req, 2, 1)
    r = auto.rates[req]
    assert r[0] > 0.99 and r[1] < 0.01 and r[2:] == [0.5, 0.5]
    assert expected_tokens(r, 1) == pytest.approx(1 + r[0]) and expected_tokens(r, 4) == pytest.approx(2.0, abs=0.02)
    assert auto.draft_count(req, 4) == 1
    assert choose_k(0.5, 0.1, 0.02, 4) == 2  # the pooled rate's choice
    assert expected_tokens([0.9, 0.5], 3) == pytest.approx(1 + 0.9 + 0.45 + 0.225)  # past the list: its last rate
    assert expected_tokens([0.7] * 4, 4) == pytest.approx(expected_tokens(0.7, 4))


def test_auto_needs_no_head_and_refuses_other_strings(small_config):
    from serve_helpers import small_model

    assert Engine(small_model(small_config), None, max_slots=1, max_model_len=16,
                  num_speculative_tokens="auto").spec_auto is None  # fmt: skip
    want = r"num_speculative_tokens must be an integer in \[0, 16\], got 'fast' \(or \"auto\"\)"
    with pytest.raises(ConfigError, match=want):
        Engine(small_model(small_config), None, max_slots=1, max_model_len=16, num_speculative_tokens="fast")


# ---- the engine ----------------------------------------------------------------------------------------------------
LENS = [3, 17, 9, 30]
PROMPTS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(500 + n)).tolist() for n in LENS]
PARAMS = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model(small_config_module):
    return spec_model(small_config_module)


@pytest.fixture(scope="module")
def plain(model):
    engine = Engine(model, None, max_slots=4, max_model_len=160, max_num_batched_tokens=64)
    return [c for r in [engine.add_request(p, PARAMS) for p in PROMPTS] for c in r.choices], engine


def _run(engine):
    reqs = [engine.add_request(p, PARAMS) for p in PROMPTS]
    while engine.has_unfinished():
        engine.step()
    return reqs


def _auto_engine(model, fixed=(0.1, 0.02)):
    engine = Engine(model, None, max_slots=4, max_model_len=160, max_num_batched_tokens=64,
                    num_speculative_tokens="auto")  # fmt: skip
    engine.spec_auto.fixed = fixed
    return engine


def _plain_run(plain):
    reqs, engine = plain
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_auto_keeps_drafting_when_drafts_are_right(model, plain):
    """Drafts of the plain continuation, 10% made wrong: every request keeps k > 0 to its end, most tokens come
    from accepted drafts, and the tokens are the plain run's."""
    want = _plain_run(plain)
    engine = _auto_engine(model)
    KnownDrafts(engine, {tuple(p): r.output_ids for p, r in zip(PROMPTS, want, strict=True)}, p_wrong=0.1)
    got = _run(engine)
    assert compare_greedy(want, got) == []
    auto, s = engine.spec_auto, engine.stats
    assert all(auto.last_k[r] > 0 for r in got), [auto.last_k[r] for r in got]
    assert s.spec_accepted > 0.5 * sum(len(r.output_ids) for r in got) and s.acceptance_rate > 0.7


def test_auto_steps_aside_when_drafts_fail(model, plain):
    """The random head's drafts are almost all rejected: each request's k falls to 0 (its steps go plain, with a
    one-draft probe every `probe_every` steps), far fewer drafts than fixed k would make, and the same tokens."""
    want = _plain_run(plain)
    engine = _auto_engine(model)
    got = _run(engine)
    assert compare_greedy(want, got) == []
    auto, s = engine.spec_auto, engine.stats
    assert all(auto.last_k[r] == 0 for r in got), [auto.last_k[r] for r in got]
    assert s.acceptance_rate < 0.2
    tokens = sum(len(r.output_ids) for r in got)
    assert s.spec_drafted < 0.25 * tokens  # fixed k = 4 would draft ~4 per token
    assert auto.probes >= len(got)  # the probes kept coming
    assert all(auto.backoff[r] > 1 for r in got)  # each failed probe doubled the wait


def test_auto_turns_off_when_verification_costs(model, plain):
    """Right drafts but a verify cost that eats their gain (v = 2): no request ever drafts, not even a probe
    (drafts certain to be accepted would not pay either), and no step takes the speculative path (the requests
    start plain: no head cells for their prompts)."""
    want = _plain_run(plain)
    engine = _auto_engine(model, fixed=(0.1, 2.0))
    forward, spec_steps = engine.speculator.forward, []
    engine.speculator.forward = lambda *a, **k: spec_steps.append(1) or forward(*a, **k)
    KnownDrafts(engine, {tuple(p): r.output_ids for p, r in zip(PROMPTS, want, strict=True)}, p_wrong=0.0)
    got = _run(engine)
    assert compare_greedy(want, got) == []
    assert all(engine.spec_auto.last_k.get(r, 0) == 0 for r in got)  # (never asked: they started plain)
    assert engine.spec_auto.probes == 0 and engine.stats.spec_drafted == 0 and spec_steps == []


def test_no_probes_where_certain_drafts_would_gain_a_few_percent(model, plain):
    """Costs c + v = 0.9: one certain draft would gain 2 / 1.9 = 1.05, inside the noise of measured costs, while
    every probe is a speculative step: the requests step aside and never probe (a probe needs `probe_gain`)."""
    want = _plain_run(plain)
    engine = _auto_engine(model, fixed=(0.45, 0.45))
    KnownDrafts(engine, {tuple(p): r.output_ids for p, r in zip(PROMPTS, want, strict=True)}, p_wrong=0.5)
    got = _run(engine)
    assert compare_greedy(want, got) == []
    assert engine.spec_auto.probes == 0 and engine.stats.spec_drafted == 0


class _FirstDraftRight(KnownDrafts):
    """Draft 1 from the plain continuation, every later draft wrong: the trained head's pattern, exaggerated."""

    def __call__(self, reqs, want, logits, r_last) -> None:
        super().__call__(reqs, want, logits, r_last)
        for req in reqs:
            req.drafts = req.drafts[:1] + [(t + 1) % self.vocab for t in req.drafts[1:]]


def test_auto_drafts_one_when_only_the_first_draft_is_right(model, plain):
    """Only the first draft is ever accepted: each request settles on k = 1 (E(k) = 2 for every k >= 1, so more
    drafts only cost), where a rate pooled over positions (~0.5) would keep asking for 2; same tokens."""
    want = _plain_run(plain)
    engine = _auto_engine(model)
    _FirstDraftRight(engine, {tuple(p): r.output_ids for p, r in zip(PROMPTS, want, strict=True)}, p_wrong=0.0)
    got = _run(engine)
    assert compare_greedy(want, got) == []
    assert all(engine.spec_auto.last_k[r] == 1 for r in got), [engine.spec_auto.last_k[r] for r in got]
    assert engine.stats.acceptance_rate > 0.8


class _Req:
    """A stand-in request: what `AutoSpec.before_step` reads and writes."""

    def __init__(self, num_cached: int):
        self.spec_k, self.finished, self.drafts, self.num_cached = 4, False, [7, 8], num_cached
        self.mtp_cells, self.resume_residual = num_cached, None
        self.prompt_ids, self.output_ids = [1] * num_cached, [5]  # one known token to feed: a plain decode's
        self.params, self.forks, self.choices = SamplingParams(), None, []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def test_calibration_pauses_speculation_for_one_plain_step():
    """After `calibrate_every` speculative decode steps of a bucket with no plain one, its speculating requests
    go plain for one step (their drafts dropped) and come back the step after, their head restarting at the
    current position; a fixed-k request is left alone."""
    auto = AutoSpec(calibrate_every=3)
    reqs, fixed = [_Req(10), _Req(20)], _Req(5)
    fixed.params = SamplingParams(num_speculative_tokens=2)
    plan = [(r, 1) for r in [*reqs, fixed]]
    for _ in range(2):
        auto.record_plan(plan, 0.01)
        auto.before_step([*reqs, fixed])
        assert all(r.spec_k == 4 for r in reqs)
    auto.record_plan(plan, 0.01)  # the third speculative step since a plain one
    auto.before_step([*reqs, fixed])
    assert [r.spec_k for r in reqs] == [0, 0] and all(r.drafts == [] for r in reqs) and fixed.spec_k == 4
    reqs[0].num_cached = 11
    auto.before_step([*reqs, fixed])
    assert [r.spec_k for r in reqs] == [4, 4] and reqs[0].mtp_cells == 11


def test_plain_step_time_is_fast_down_slow_up_and_calibrated_early():
    """The plain step time t0 takes a faster sample at once and averages a slower one in (shared-machine noise
    only adds time); the first calibration step comes after 8 speculative steps, the next after 32, then
    `calibrate_every` (each costs two steps without drafts)."""
    auto = AutoSpec(calibrate_every=64)
    reqs = [_Req(10), _Req(20)]
    spec = [(r, 1) for r in reqs]
    for r in reqs:
        r.spec_k = 0
    auto.record_plan(spec, 0.030)  # a slow first plain sample
    auto.record_plan(spec, 0.010)
    assert auto.model.plain[2] == 0.010
    auto.record_plan(spec, 0.020)
    assert auto.model.plain[2] == pytest.approx(0.011)
    for r in reqs:
        r.spec_k = 4
    for _ in range(8):
        auto.before_step(reqs)
        assert all(r.spec_k == 4 for r in reqs)
        auto.record_plan(spec, 0.012)
    auto.before_step(reqs)  # the 8th speculative step since a plain one, with 3 plain samples: not yet (64)
    assert all(r.spec_k == 4 for r in reqs)
    auto.plain_count[2] = 1  # one plain sample: after 32
    auto.before_step(reqs)
    assert all(r.spec_k == 4 for r in reqs)
    auto.plain_count[2] = 0  # none: calibrate now
    auto.before_step(reqs)
    assert [r.spec_k for r in reqs] == [0, 0]


# ---- measured tokens per second price k -----------------------------------------------------------------------
def _steps(auto, batch, k, seconds, tokens=None, model_seconds=0.010):
    """Whole decode-only engine steps of `batch` stand-in requests with k drafts each (k = 0: plain) taking
    `seconds` each and emitting `tokens` each (default one per entry), their model step `model_seconds` (what the
    cost model's line sees)."""
    reqs = [_Req(10) for _ in range(batch)]
    for r in reqs:
        r.spec_k, r.drafts = (4, [7] * k) if k else (0, [])
    for s in seconds:
        auto.record_plan([(r, 1) for r in reqs], model_seconds)
        reqs[0].output_ids.extend([5] * (batch if tokens is None else tokens))
        auto.record_step_end(s)


def _cheap_drafts_by_the_model(auto, batch):
    """Model steps and proposals that make drafts look cheap to the cost model (c = 0.1, v ~ 0.02 batch)."""
    for x in (0, 3, 0, 3):
        auto.model.record_step(batch, x, 0.010 + 0.0002 * x)
    auto.model.record_drafts(batch, 1, 0.001)
    auto.model.plain[bucket(batch)] = 0.010


def test_measured_tokens_per_second_turn_drafting_off_where_the_cost_model_would_draft():
    """The cost model (draft 0.1 of a plain step, verify tokens nearly free) says draft; whole engine steps
    measured at k = 1..4 (rollbacks, replays, proposal and host work included) emit too few tokens for their time:
    no k's measured tokens per second beat plain decoding's, so the request goes plain (k = 0, spec_k 0) and no
    probe is armed."""
    auto = AutoSpec(min_samples=3)
    _cheap_drafts_by_the_model(auto, 1)
    req = _Req(10)
    for _ in range(40):
        auto.observe(req, 4, 2)  # ~[1, 1, 0, .5]: E(k) 2, 3, 3, 3
    rates = auto.rates[req]
    assert choose_k(rates, *auto.model.costs(1), 4, auto.min_gain) > 0  # what the cost model alone chose
    _steps(auto, 1, 0, [0.010] * 2)
    for k, t, n in ((1, 0.021, 2), (2, 0.031, 3), (3, 0.040, 3), (4, 0.050, 3)):
        _steps(auto, 1, k, [t] * 3, n)
    assert auto.gains(1, rates) == pytest.approx([1.0, 2 / 2.1, 3 / 3.1, 0.75, 0.6])
    assert auto.draft_count(req, 4) == 0 and req.spec_k == 0 and req.drafts == []
    assert not auto._could_pay(1)  # no probe either


def test_measured_tokens_per_second_pick_the_best_k():
    """A first draft accepted 0.95 and later ones 0.5: the cost model (priors c + v = 0.305) takes k = 2. Measured
    k = 2 steps (2 plain steps' time, 7 tokens in 3 steps: gain 1.17) price k = 2 and, through its per-draft cost,
    k = 1 (1 + 0.54 a draft: 1.27) -> k = 1; measured k = 1 (1.3 plain steps, 2 tokens: 1.54) stays best against
    measured k = 3 and 4. A step without drafts of a request drafting k (a replay after rejections) counts for k;
    buckets are kept apart; one probing request in a plain batch prices nothing."""
    auto = AutoSpec(min_samples=3)
    req = _Req(10)
    auto.rates[req] = rates = [0.95, 0.5, 0.5, 0.5]
    model = [expected_tokens(rates, k) / (1 + 0.305 * k) for k in range(5)]
    assert auto.gains(1, rates) == pytest.approx(model) and auto.draft_count(req, 4) == 2
    _steps(auto, 1, 0, [0.010, 0.012])  # plain: fast down, slow up -> 0.0102
    t0 = auto.wholes.plain[1]
    _steps(auto, 1, 2, [2.0 * t0], 3)
    _steps(auto, 1, 2, [2.0 * t0], 2)
    assert auto.gains(1, rates)[2] == pytest.approx(model[2])  # two samples: not yet measured
    _steps(auto, 1, 2, [2.0 * t0], 2)
    g = auto.gains(1, rates)
    per = (expected_tokens(rates, 2) / (7 / 6) - 1) / 2
    assert g[2] == pytest.approx(7 / 6) and g[1] == pytest.approx(1.95 / (1 + per))
    assert auto.draft_count(req, 4) == 1
    for k, r, n in ((1, 1.3, 2), (3, 2.6, 3), (4, 3.0, 3)):
        _steps(auto, 1, k, [r * t0] * 3, n)
    assert auto.gains(1, rates) == pytest.approx([1.0, 2 / 1.3, 7 / 6, 3 / 2.6, 1.0])
    assert auto.draft_count(req, 4) == 1 and auto.draft_count(req, 1) == 1
    assert auto._could_pay(1)  # measured k = 1 gains 1.54 >= probe_gain
    replay = _Req(10)
    replay.drafts, auto.last_k[replay] = [], 2
    auto.record_plan([(replay, 1)], 0.010)
    assert auto._pending[1] == 2  # the replay step counts for k = 2
    auto._pending = None
    assert auto.gains(16) == pytest.approx([expected_tokens(0.5, k) / (1 + k * (0.3 + 0.005 * 16)) for k in range(5)])
    _steps(auto, 16, 0, [0.010])
    lone = [_Req(10) for _ in range(16)]  # one request probing in a plain batch: under half a draft per entry
    for r in lone[1:]:
        r.spec_k, r.drafts = 0, []
    for _ in range(5):
        auto.record_plan([(r, 1) for r in lone], 0.010)
        auto.record_step_end(0.010)
    assert (16, 1) not in auto.wholes.steps and (16, 2) not in auto.wholes.steps and auto.wholes.plain[16] == 0.010 / 16


def test_measured_steps_shrug_off_a_burst_and_are_forgotten_when_stale():
    """Load comes in bursts that double a few steps in a row: k = 1 steps (2 tokens each) first measured at 3 plain
    steps, then at 1.2: the price drops at once (a mean would have kept k = 1 off), later bursts are left out,
    while a step's own variation (a replay, 1.44x for one token) averages in. A k whose latest whole step is more
    than `forget` decode steps old prices by the cost model again (so drafting turned off by a cost measured under
    load is retried) and, retried, by its new steps alone; a cost model fit in a burst prices no dearer than the
    priors."""
    auto = AutoSpec(min_samples=3, forget=20)
    req = _Req(10)
    auto.rates[req] = rates = [0.9] * 4
    model = [expected_tokens(rates, k) / (1 + 0.305 * k) for k in range(5)]
    for x in (0, 3, 0, 3):  # the cost model's line fit in a burst: no dearer than the priors for k not measured
        auto.model.record_step(1, x, 0.050 + 0.02 * x)
    auto.model.record_drafts(1, 1, 0.040)
    assert sum(auto.model.costs(1)) > 1.0 and auto.gains(1, rates) == pytest.approx(model)
    _steps(auto, 1, 0, [0.010])
    _steps(auto, 1, 1, [0.030] * 3, 2)
    assert auto.gains(1, rates)[1] == pytest.approx(2 / 3) and auto.draft_count(req, 1) == 0
    _steps(auto, 1, 1, [0.012], 2)
    assert auto.gains(1, rates)[1] == pytest.approx(2 / 1.2) and auto.draft_count(req, 1) == 1
    for t, n in [(0.030, 2)] * 3 + [(0.012, 2), (0.014, 2), (0.0144, 1)]:  # a burst, steps, a replay
        _steps(auto, 1, 1, [t], n)
    assert auto.gains(1, rates)[1] == pytest.approx(0.010 / ((0.012 * 2 + 0.014 + 0.0144) / 7))
    _steps(auto, 1, 0, [0.010] * 20)
    assert auto.gains(1, rates)[1] == pytest.approx(0.010 / ((0.012 * 2 + 0.014 + 0.0144) / 7))  # 20 steps: kept
    _steps(auto, 1, 0, [0.010])
    assert auto.gains(1, rates) == pytest.approx(model)  # k = 1 forgotten: the priors
    _steps(auto, 1, 1, [0.011] * 3, 3)  # retried on the text of now: its new steps alone price it
    assert auto.gains(1, rates)[1] == pytest.approx(0.010 / (0.011 / 3))


def test_past_batch_one_every_auto_request_drafts_the_same_k():
    """Entries of unequal lengths leave the verify step's equal-length paths, so past batch 1 the choice is one k
    for the step, from the running requests' mean acceptance per position; alone, each request's own rates."""
    auto = AutoSpec(fixed=(0.1, 0.0))
    sure, poor = _Req(10), _Req(20)
    auto.rates[sure], auto.rates[poor] = [1.0] * 4, [0.05] * 4
    auto.before_step([sure])
    assert auto.draft_count(sure, 4) == 4 and auto.draft_count(poor, 4) == 0  # their own choices
    poor.spec_k = 4
    auto.before_step([sure, poor])
    assert auto.batch_rates == pytest.approx([0.525] * 4)
    want = choose_k(0.525, 0.1, 0.0, 4, auto.min_gain)
    assert want == 2 and auto.draft_count(sure, 4) == want and auto.draft_count(poor, 4) == want


def test_a_bucket_without_measurements_borrows_the_nearest_measured_draft_cost():
    """Requests finishing at different steps take a batch into smaller buckets late in a run: an unmeasured bucket
    prices drafts no cheaper than the nearest measured bucket's per-draft cost (batch 16: k = 1 at 1.1x plain with
    E(1) = 1.98 -> 0.8 plain steps a draft), not from the priors (which would take k = 2 at 0.6 acceptance)."""
    auto = AutoSpec(min_samples=3)
    rates = [0.98, 0.6, 0.6, 0.6]
    prior = [expected_tokens(rates, k) / (1 + k * (0.3 + 0.005 * 8)) for k in range(5)]
    assert pick_k(prior, auto.min_gain) == 2 and auto.gains(8, rates) == pytest.approx(prior)
    _steps(auto, 16, 0, [0.016])  # a plain step: 1 ms a token
    _steps(auto, 16, 1, [0.032 / 1.1] * 3, 32)  # 32 tokens a step: gain 1.1
    per = (expected_tokens(rates, 1) / 1.1 - 1) / 1
    want = [expected_tokens(rates, k) / (1 + k * per) for k in range(5)]
    assert auto.gains(8, rates) == pytest.approx(want) and pick_k(want, auto.min_gain) == 1
    assert auto.gains(1, rates) == pytest.approx(want)  # the nearest measured bucket, however far


# ---- what a plain step and a k step are measured from ---------------------------------------------------------
def test_a_plain_step_with_replays_does_not_price_plain_decoding():
    """A plain step where an entry re-feeds tokens after rejected drafts (the calibration step right after
    speculative ones) takes the multi-token path, slower than plain decoding: it is not the plain reference, and a
    calibration waits for a step where every request feeds its one token."""
    auto = AutoSpec()
    reqs = [_Req(10) for _ in range(2)]
    for r in reqs:
        r.spec_k, r.drafts = 0, []
    auto.record_plan([(reqs[0], 1), (reqs[1], 3)], 0.030)  # a replay of 3 tokens
    auto.record_step_end(0.031)
    assert 2 not in auto.model.plain and 2 not in auto.wholes.plain and auto._pending is None
    auto.record_plan([(r, 1) for r in reqs], 0.010)
    auto.record_step_end(0.011)
    assert auto.model.plain[2] == 0.010 and auto.wholes.plain[2] == pytest.approx(0.011 / 2)
    for r in reqs:
        r.spec_k = 4
    auto.since_plain[2] = 8  # calibration due (none measured before: after 8)
    auto.plain_count[2] = 0
    reqs[1].num_cached -= 2  # a replay of 3 tokens is due
    auto.before_step(reqs)
    assert [r.spec_k for r in reqs] == [4, 4]  # not now
    reqs[1].num_cached += 2
    auto.before_step(reqs)
    assert [r.spec_k for r in reqs] == [0, 0]  # now


def test_a_requests_last_step_is_no_cost_of_its_k():
    """At its last token a request has no room for drafts: its step without drafts emits one token at about a plain
    step's cost. Counted for its latest k (as a replay is) it passed for a cheap k step, set k's envelope and made
    k's real steps look like bursts; it is not counted."""
    from flashnext.serve.speculative import Speculator

    auto = AutoSpec()
    spec = object.__new__(Speculator)
    spec.auto, spec.max_model_len = auto, 1000
    req = _Req(10)
    req.params = SamplingParams(max_tokens=3)
    req.output_ids, req.prompt_ids = [5, 6], [1] * 9  # one token to go
    auto.last_k[req], req.drafts = 1, []
    assert spec.draft_count(req) == 0 and auto.last_k[req] == 1
    auto.record_plan([(req, 1)], 0.010)
    assert auto._pending is None  # neither a plain step nor one of k = 1


def test_a_ks_envelope_comes_from_steps_that_drafted():
    """k = 1 steps with drafts take 1.6x the steps of k = 1 without (a head restarting, a replay): the burst filter's
    envelope is that of the steps with drafts, so both count; an envelope of all of them took the cheap steps
    alone (1.6 > 1.5) and priced k = 1 at one token per 10 ms where it costs 13 ms."""
    auto = AutoSpec(min_samples=3)
    _steps(auto, 1, 0, [0.010])
    _steps(auto, 1, 1, [0.016] * 4, 2)  # with drafts, 2 tokens each
    reqs = [_Req(10)]
    reqs[0].drafts, auto.last_k[reqs[0]] = [], 1  # without drafts, counted for k = 1
    for _ in range(4):
        auto.record_plan([(reqs[0], 1)], 0.010)
        reqs[0].output_ids.append(5)
        auto.record_step_end(0.010)
    assert auto.wholes.steps[1, 1].n == 8
    assert auto.gains(1)[1] == pytest.approx(0.010 / ((4 * 0.016 + 4 * 0.010) / 12))


def test_probes_are_judged_at_certain_acceptance_of_the_measured_steps():
    """Measured k = 1 steps gain 1.1 at 1.6 tokens a step: below `probe_gain`, but every draft accepted they would
    gain 1.1 * 2 / 1.6 = 1.375, so a request that stepped aside probes (comparing the measured gain itself, made at
    the acceptance seen, with `probe_gain` kept it plain for good)."""
    auto = AutoSpec(min_samples=3)
    _steps(auto, 1, 0, [0.010])
    t = 1.6 / 1.1 * 0.010
    for n in (2, 1, 2, 2, 1):  # 8 tokens in 5 steps
        _steps(auto, 1, 1, [t], n)
    assert auto.gains(1)[1] == pytest.approx(1.1)
    assert auto.gains(1, [1.0] * 4, certain=True)[1] == pytest.approx(1.1 * 2 / 1.6)
    assert auto._could_pay(1)


# ---- measurements kept across engines ---------------------------------------------------------------------------
def test_measurements_are_kept_per_model_across_engines(small_config):
    """Engines over one model share what they measured (per device, dtype and decode path), so a second engine
    starts from the first's costs: where the first measured that k = 1 loses, the second's queued requests start
    plain; a model, or a decode path, of its own starts from the priors."""
    from flashnext.serve.spec_costs import Kept, kept_for

    model = spec_model(small_config)  # its own: the module's model carries what other tests' engines measured
    first = _auto_engine(model, fixed=None)
    second = _auto_engine(model, fixed=None)
    assert first.spec_auto.wholes is second.spec_auto.wholes and first.spec_auto.model is second.spec_auto.model
    assert first.spec_auto is not second.spec_auto  # acceptance and the requests' state stay per engine
    graph = kept_for(model, ("cpu", torch.float32, True))
    assert graph is not kept_for(model, ("cpu", torch.float32, False)) and isinstance(graph, Kept)
    assert AutoSpec().wholes is not first.spec_auto.wholes  # no kept measurements given: fresh ones
    assert second.spec_auto._could_pay(4)  # the priors
    _steps(first.spec_auto, 4, 0, [0.010] * 2)
    _steps(first.spec_auto, 4, 1, [0.030] * 3, 6)  # k = 1: 6 tokens in 3 plain steps' time
    assert second.spec_auto.wholes.clock == 5 and not second.spec_auto._could_pay(4)
    queued = [_Req(0) for _ in range(4)]
    second.spec_auto.before_step([], queued, 4)
    assert [r.spec_k for r in queued] == [0, 0, 0, 0]


def test_a_calibration_that_finds_no_k_paying_leaves_the_requests_plain():
    """The calibration's plain step shows k = 1 (measured) at a loss: the paused requests stay plain (no step
    restarting their heads without drafts, only to be sent plain after it); where k = 1 pays they are re-armed."""
    for k_seconds, want in ((0.030, 0), (0.012, 4)):
        auto = AutoSpec(min_samples=3)
        reqs = [_Req(10), _Req(20)]
        _steps(auto, 2, 1, [k_seconds] * 8, 4)  # 8 speculative steps of k = 1, 4 tokens each: calibration due
        auto.before_step(reqs)
        assert [r.spec_k for r in reqs] == [0, 0]  # paused
        _steps(auto, 2, 0, [0.010])  # the plain step
        auto.before_step(reqs)
        assert [r.spec_k for r in reqs] == [want, want]
        assert all(auto.last_k.get(r) == 0 for r in reqs) if want == 0 else all(r not in auto.plain_steps for r in reqs)
