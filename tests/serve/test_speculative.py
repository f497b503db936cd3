"""Speculative decoding with the MTP head: exactness (greedy tokens, sampled distribution, log-probs), rollback,
mixed batches, n choices, failures and refusals.

The small model's random MTP head drafts are almost all rejected (acceptance ~1%), which exercises rollback on
nearly every step; `KnownDrafts` feeds the plain run's continuation with some tokens made wrong, so full,
partial and no acceptance all occur. Greedy runs are compared token for token with the plain (k = 0) run: a
verify step computes 1 + k positions at once (and replays after a rejection), which moves fp32 logits by
rounding, so a divergence is allowed only where the plain run's top-2 logits are within `TIE` (reported).
"""

from __future__ import annotations

import itertools
import logging
import re

import pytest
import torch
from serve_helpers import StepFault, small_model
from spec_helpers import KnownDrafts, compare_greedy, full_forward_logprobs, run_mixed, spec_model

from flashnext.errors import ConfigError
from flashnext.model.state import POSITIONAL, RECURRENT, WINDOW
from flashnext.serve import speculative
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import FieldError, SamplingParams
from flashnext.serve.stats import EngineStats, prometheus_text


@pytest.fixture(scope="module")
def model(small_config_module):
    return spec_model(small_config_module)


# ---- greedy: the tokens of k = 0 ------------------------------------------------------------------------------
LENS = [3, 40, 7, 12, 1, 25, 9, 17, 30, 5, 2, 14, 21, 6, 11, 33]
PROMPTS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(100 + n)).tolist() for n in LENS]
# The first request runs into max_model_len (297 new tokens); the others leave at their own max_tokens.
MAX_TOKENS = [400, 93, 16, 107, 88, 60, 115, 50, 113, 15, 25, 63, 76, 102, 72, 65]
WAVES = [0, 5, 20, 40]  # requests join at these steps (dealt round-robin)
MAX_LEN = 300


def _params(k: int, logprobs: int | None) -> list[SamplingParams]:
    """Every fourth request does not speculate (mixed batches); the rest use the engine's k (None)."""
    return [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                       num_speculative_tokens=0 if i % 4 == 0 else None)
        for i, m in enumerate(MAX_TOKENS)
    ]  # fmt: skip


def _engine(model, k: int) -> Engine:
    """12 slots for 16 requests (admissions wait for slots), a 48-token budget (prompt chunks beside decodes)."""
    return Engine(model, None, max_slots=12, max_model_len=MAX_LEN, max_num_batched_tokens=48, num_speculative_tokens=k)


@pytest.fixture(scope="module")
def plain(model):
    return run_mixed(_engine(model, 0), PROMPTS, _params(0, 2), WAVES)


@pytest.mark.parametrize(
    ("k", "drafts"),
    [(1, "known"), (3, "known"), (3, "head"), pytest.param(1, "head", marks=pytest.mark.slow)],  # k=1 head: k=3's
    ids=["known-1", "known-3", "head-3", "head-1"],
)
def test_greedy_speculation_gives_the_plain_tokens(model, plain, k, drafts):
    """16 mixed-length prompts, 12 slots, requests joining and leaving, one running to max_model_len (297 new
    tokens), prompt chunks and decodes in the same steps, a quarter of the requests not speculating: every token
    equals the plain run's, and the log-probs of the emitted tokens are the target's (full forward, 1e-5)."""
    engine = _engine(model, k)
    if drafts == "known":
        KnownDrafts(engine, {tuple(p): r.output_ids for p, r in zip(PROMPTS, plain, strict=True)}, p_wrong=0.25)
    spec = run_mixed(engine, PROMPTS, _params(k, 0), WAVES)
    ties = compare_greedy(plain, spec)
    print(f"k={k} drafts={drafts}: near-tie divergences {ties}")
    s = engine.stats
    assert s.spec_drafted > 0 and s.spec_verify_steps > 0 and s.spec_replayed_tokens > 0
    if drafts == "known":  # every acceptance pattern happened (with the random head almost all are rejected)
        assert 0.4 < s.acceptance_rate < 0.9 and s.mean_accepted_length > 1.3
    assert all(r.num_drafted == 0 for r in spec[::4])  # those requests did not speculate
    assert sum(r.num_accepted for r in spec) == s.spec_accepted
    for i in (0, 1, 6):  # the log-probs of what was emitted, against one plain forward of prompt + output
        want = full_forward_logprobs(model, PROMPTS[i], spec[i].output_ids)
        torch.testing.assert_close(torch.tensor(spec[i].logprobs), want, atol=1e-5, rtol=0)


# ---- rollback: the state of a run that never saw the rejected drafts ---------------------------------------
POISON = 1e4  # finite (a masked-out row times 0 stays 0), and far off every real value: any read shows


def test_rollback_restores_and_rejected_writes_stay_invisible(model, monkeypatch):
    """Without per-position states (past `KEEP_BYTES`, or entries of unequal lengths), after every step that
    rejected drafts: the slot's window and recurrent states are bitwise those before the step (what a run that
    never saw the drafts holds: the drafts were fed in that step only), and its positional rows below the committed
    length are bitwise untouched. Everything at or past that length, which the rejected drafts wrote, is then
    overwritten with a poison value: the request still gives the plain tokens, and log-probs equal to one full
    forward's (1e-5), so no later query ever read a row a rejected draft wrote."""
    monkeypatch.setattr(speculative, "KEEP_BYTES", -1)
    prompt = PROMPTS[5]
    want = run_mixed(_engine(model, 0), [prompt], [SamplingParams(max_tokens=60, temperature=0.0)], [0])[0]
    engine = _engine(model, 3)
    KnownDrafts(engine, {tuple(prompt): want.output_ids}, p_wrong=0.4, seed=3)
    req = engine.add_request(prompt, SamplingParams(max_tokens=60, temperature=0.0, logprobs=0))
    engine.step()  # admission and prefill
    kinds = {id(b): kind for b, kind in engine.cache._kinds}
    trunk = [(getattr(part, f), f) for layer in engine.cache.layers[: len(model.model.layers)]
             for part in layer.values() for f in vars(part)]  # fmt: skip
    checked = 0
    while not req.finished:
        before, cached = [b[req.slot].clone() for b, _ in trunk], req.num_cached
        replayed = engine.stats.spec_replayed_tokens
        engine.step()
        if engine.stats.spec_replayed_tokens == replayed or req.finished:
            continue
        checked += 1
        assert req.num_cached == cached  # rolled back to where the step started
        for (buf, field), old in zip(trunk, before, strict=True):
            rows = buf.shape[1]  # a window or recurrent state: all of it
            if kinds[id(buf)] == POSITIONAL:  # rows by position (pooled block keys: by complete block of 4)
                rows = req.num_cached // 4 if field == "block_k" else req.num_cached
            assert torch.equal(buf[req.slot][:rows], old[:rows]), field
            buf[req.slot][rows:] = POISON
    assert checked >= 3
    assert req.output_ids == want.output_ids
    full = full_forward_logprobs(model, prompt, req.output_ids)
    torch.testing.assert_close(torch.tensor(req.logprobs), full, atol=1e-5, rtol=0)


def test_a_rejection_keeps_the_accepted_prefix_without_a_replay(model, monkeypatch):
    """A lone request's verify step is one short entry, so the step keeps the state after every position: after a
    rejection the slot continues from its last accepted token (`num_cached` past the known tokens and the accepted
    drafts, no token fed again), its window and recurrent states equal a plain run's after the same tokens (1e-5:
    the verify step's products run on more rows), and with every positional row past the committed length
    poisoned the request still gives the plain tokens and log-probs equal to one full forward's (1e-5). The
    snapshots before such steps copy the windows alone (the recurrent states come from the step)."""
    prompt = PROMPTS[5]
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=0)
    want = run_mixed(_engine(model, 0), [prompt], [params], [0])[0]
    plain_engine, engine = _engine(model, 0), _engine(model, 3)
    snapshot, copied = engine.cache.snapshot, []
    monkeypatch.setattr(engine.cache, "snapshot", lambda *a, **k: copied.append(snapshot(*a, **k)) or copied[-1])
    KnownDrafts(engine, {tuple(prompt): want.output_ids}, p_wrong=0.4, seed=3)
    ref, req = plain_engine.add_request(prompt, params), engine.add_request(prompt, params)
    engine.step()  # admission and prefill
    kinds = {id(b): kind for b, kind in engine.cache._kinds}
    trunk, ref_trunk = ([(getattr(part, f), f) for layer in e.cache.layers[: len(model.model.layers)]
                         for part in layer.values() for f in vars(part)] for e in (engine, plain_engine))  # fmt: skip
    checked = 0
    while not req.finished:
        cached, fed, accepted = req.num_cached, req.num_tokens - req.num_cached, req.num_accepted
        drafts = len(req.drafts)
        engine.step()
        if req.finished or not drafts or req.num_accepted - accepted == drafts:
            continue
        checked += 1
        assert req.num_cached == cached + fed + req.num_accepted - accepted  # nothing to feed again
        assert req.num_tokens - req.num_cached == 1
        while ref.num_cached < req.num_cached:
            plain_engine.step()
        assert ref.num_cached == req.num_cached
        for (buf, field), (ref_buf, _) in zip(trunk, ref_trunk, strict=True):
            if kinds[id(buf)] == POSITIONAL:  # rows past the committed length: whatever a rejected draft wrote
                rows = req.num_cached // 4 if field == "block_k" else req.num_cached
                buf[req.slot][rows:] = POISON
            else:
                torch.testing.assert_close(buf[req.slot], ref_buf[ref.slot], atol=1e-5, rtol=0)
    assert checked >= 3 and engine.stats.spec_replayed_tokens == 0
    copied_kinds = {kinds[id(buf)] for snap in copied for buf, _ in snap.rows}
    assert copied and RECURRENT not in copied_kinds and copied_kinds == {WINDOW}
    assert req.output_ids == want.output_ids
    full = full_forward_logprobs(model, prompt, req.output_ids)
    torch.testing.assert_close(torch.tensor(req.logprobs), full, atol=1e-5, rtol=0)


# ---- sampled: the target distribution ------------------------------------------------------------------------
def _processed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The plain sampler's distribution, written out: softmax(logits / T), top-k, then top-p (the smallest set of
    most likely tokens whose mass reaches top_p), renormalised. logits [n, V] -> float64 [n, V]."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    if p.top_k:
        kth = torch.topk(logits, p.top_k, -1).values[:, -1:]
        probs = torch.where(logits >= kth, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if p.top_p < 1:
        srt, order = probs.sort(-1, descending=True)
        keep = (srt.cumsum(-1) - srt) < p.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, torch.where(keep, srt, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def _next_probs(model, prompt, contexts, p: SamplingParams) -> torch.Tensor:
    """The target's sampling distribution after prompt + each context, one packed forward. -> [len(contexts), V]"""
    ids = torch.tensor([prompt + list(c) for c in contexts])
    n, length = ids.shape
    with torch.no_grad():
        logits = model(ids.flatten(), cu_seqlens=torch.arange(0, n * length + 1, length, dtype=torch.int32)).logits
    return _processed(logits.view(n, length, -1)[:, -1].float(), p)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expecting fewer than 5 are pooled into one."""
    obs, exp = counts.double().flatten(), probs.flatten() * counts.sum()
    small = exp < 5
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


class TargetArgmaxDrafts:
    """Drafts = the target's most likely token after each context (from the exact tables): accepted often, but
    not always, so acceptance, rejection with resampling and the bonus token all occur many times."""

    def __init__(self, engine, prompt_len: int, tables: dict[tuple, int]):
        self.n, self.tables = prompt_len, tables
        engine.speculator._draft = self

    def __call__(self, reqs, want, logits, r_last) -> None:
        for req, w in zip(reqs, want, strict=True):
            ctx = list(req.output_ids)
            for _ in range(w):
                ctx.append(self.tables[tuple(ctx)])
            req.drafts = ctx[len(req.output_ids) :]


SAMPLED = {
    "temperature": SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True),
    "top_k_top_p": pytest.param(
        SamplingParams(max_tokens=4, temperature=1.0, top_k=6, top_p=0.8, ignore_eos=True), marks=pytest.mark.slow
    ),
}


@pytest.mark.parametrize("drafts", ["target", pytest.param("head", marks=pytest.mark.slow)])
@pytest.mark.parametrize("params", list(SAMPLED.values()), ids=list(SAMPLED))
def test_sampled_speculation_keeps_the_target_distribution(small_config, params, drafts):
    """Vocab 16, k = 3, 2000 seeded requests of 4 tokens (t1 from the prefill; t2..t4 from verify steps: accepted
    drafts, resampled rejections, bonus tokens). The empirical joint of (t1, t2) and marginals of t3 and t4 fit
    the target's exact distributions, computed from full forwards over every context (chi-square, p > 1e-3 for
    each; the seeds are fixed, so the p-values are too). The "head" variant uses the random MTP head's drafts
    (rarely accepted); "target" drafts the target's argmax (accepted about a third of the time)."""
    V, prompt, N = 16, [5, 9, 2, 7], 2000
    model = spec_model({**small_config, "vocab_size": V})
    with torch.no_grad():  # sharper distributions (the random model's are nearly flat): drafts often accepted
        model.lm_head.weight.mul_(4)
    p1 = _next_probs(model, prompt, [()], params)[0]
    p2 = _next_probs(model, prompt, [(a,) for a in range(V)], params)
    ctx2 = list(itertools.product(range(V), repeat=2))
    p3 = _next_probs(model, prompt, ctx2, params).view(V, V, V)
    p4 = _next_probs(model, prompt, list(itertools.product(range(V), repeat=3)), params).view(V, V, V, V)
    engine = Engine(model, None, max_slots=64, max_model_len=16, max_num_batched_tokens=512, num_speculative_tokens=3)
    if drafts == "target":
        tables = {(a,): int(p2[a].argmax()) for a in range(V)}
        tables.update({c: int(p3[c].argmax()) for c in ctx2})
        TargetArgmaxDrafts(engine, len(prompt), tables)
    seeded = [SamplingParams(**{**vars(params), "seed": s}) for s in range(N)]
    toks = torch.tensor([c.token_ids for c in engine.generate([prompt] * N, seeded)])
    s = engine.stats
    assert s.spec_drafted > N and s.spec_accepted > (0.25 if drafts == "target" else 0) * s.spec_drafted
    joint12 = p1[:, None] * p2
    joint123 = joint12[..., None] * p3
    pairs = torch.zeros(V * V).index_add_(0, toks[:, 0] * V + toks[:, 1], torch.ones(N))
    pvalues = {
        "t1,t2": _chi2_pvalue(pairs, joint12),
        "t3": _chi2_pvalue(torch.bincount(toks[:, 2], minlength=V), joint123.sum((0, 1))),
        "t4": _chi2_pvalue(torch.bincount(toks[:, 3], minlength=V), (joint123[..., None] * p4).sum((0, 1, 2))),
    }
    print("chi-square p-values", pvalues)
    assert all(p > 1e-3 for p in pvalues.values()), pvalues


def test_sampled_log_probs_are_the_targets(model):
    """Seeded sampling with k = 3: the reported log-probs of the emitted tokens (accepted drafts, resampled and
    bonus tokens) are the target's raw log-probs, against one full forward (1e-5)."""
    engine = _engine(model, 3)
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=i, ignore_eos=True, logprobs=1) for i in range(3)]
    outs = engine.generate(PROMPTS[:3], params)
    for prompt, out in zip(PROMPTS[:3], outs, strict=True):
        want = full_forward_logprobs(model, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)
        assert [t[0][1] >= lp for t, lp in zip(out.top_logprobs, out.logprobs, strict=True)]


def test_processed_log_probs_and_routed_experts_under_speculation(model):
    """With k = 3: a `logprobs_mode="processed"` request reports the log-probs of the distribution it sampled from
    (the RL trainer's definition) for tokens of verify steps too; a request that records its routed experts does not
    speculate and records a row per token it ran."""
    engine = _engine(model, 3)
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, ignore_eos=True, logprobs=0,
                             logprobs_mode="processed", return_routed_experts=i == 1) for i in range(2)]  # fmt: skip
    outs = engine.generate(PROMPTS[:2], params)
    assert outs[0].num_verify_steps > 0 and outs[1].num_draft_tokens == 0  # verified tokens report through `verify`
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        want = full_forward_logprobs(model, prompt, out.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)
    cfg = model.config
    assert outs[0].routed_experts is None
    assert outs[1].routed_experts.shape == (len(PROMPTS[1]) + 19, cfg.num_hidden_layers, cfg.num_experts_per_tok)


# ---- n choices, failures, refusals, metrics -------------------------------------------------------------------
@pytest.mark.parametrize("budget", [48, 39], ids=["one-chunk", "chunked-one-left"])
def test_n_choices_speculate(model, plain, budget):
    """n = 3 greedy choices with k = 3 share one prefill and each gives the plain greedy tokens; also when the
    prompt's last chunk is short enough that its head cells could already propose drafts (the parent must first
    fork its children)."""
    engine = Engine(model, None, max_slots=12, max_model_len=MAX_LEN, max_num_batched_tokens=budget,
                    num_speculative_tokens=3)  # fmt: skip
    outs = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=3))
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(o.token_ids == plain[1].output_ids[:40] for o in outs)
    assert all(o.num_verify_steps > 0 for o in outs)


def test_a_failing_step_with_speculation_ends_only_its_culprit(model, plain):
    """A model step raising whenever one request's marker token is fed: that request ends with "error", the
    speculating innocents are recomputed and give the plain tokens (their MTP cells rebuilt from the history)."""
    engine = _engine(model, 3)
    innocents = [PROMPTS[3], PROMPTS[6]]
    marker = 63
    assert all(marker not in p for p in innocents)
    culprit = [marker, 1, 2]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with StepFault(model, marker=marker, where="start"):
        reqs = [engine.add_request(p, params) for p in innocents]
        engine.step()
        engine.step()
        bad = engine.add_request(culprit, params)
        while engine.has_unfinished():
            engine.step()
    assert bad.finish_reason == "error" and engine.stats.failed_steps >= 1
    for req, i in zip(reqs, (3, 6), strict=True):
        assert req.finish_reason == "length" and req.output_ids == plain[i].output_ids[:30]


def test_a_failing_draft_head_turns_speculation_off(model, plain):
    """The MTP head raising: the step's requests stop speculating and keep giving the plain tokens."""
    engine = _engine(model, 3)
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        raise RuntimeError("injected head fault")

    model.draft_step = broken
    try:
        out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    finally:
        del model.draft_step
    assert len(calls) == 1 and out.finish_reason == "length" and out.num_draft_tokens == 0
    assert out.token_ids == plain[1].output_ids[:20]


def test_refusals_name_the_setting(small_config):
    no_head = small_model(small_config)
    with pytest.raises(ConfigError, match=r"num_speculative_tokens=2 needs a model with an MTP head: this model has"):
        Engine(no_head, None, max_slots=1, max_model_len=16, num_speculative_tokens=2)
    engine = Engine(no_head, None, max_slots=1, max_model_len=16)
    with pytest.raises(FieldError, match=r"num_speculative_tokens=1: this model has no MTP draft head") as e:
        engine.add_request([1, 2], SamplingParams(num_speculative_tokens=1))
    assert e.value.field == "num_speculative_tokens"
    for bad in (-1, 17, "3", True):
        with pytest.raises(FieldError, match=rf"num_speculative_tokens must be an integer in \[0, 16\], got {bad!r}"):
            SamplingParams(num_speculative_tokens=bad).validate()
    with pytest.raises(ConfigError, match=r"must be an integer in \[0, 16\], got 17"):
        Engine(no_head, None, max_slots=1, max_model_len=16, num_speculative_tokens=17)


def test_metrics_report_acceptance(model):
    engine = _engine(model, 3)
    quiet = prometheus_text(engine)  # nothing drafted yet: no rate gauges (they read NaN before)
    assert "flashnext_spec_acceptance_rate " not in quiet and "flashnext_spec_mean_accepted_length " not in quiet
    assert "flashnext_spec_draft_tokens_total 0" in quiet
    KnownDrafts(engine, {}, p_wrong=0.0)  # drafts of token 0: accepted only where the target picks 0
    engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    s = engine.stats
    text = prometheus_text(engine)
    assert f"flashnext_spec_draft_tokens_total {s.spec_drafted}" in text and s.spec_drafted > 0
    assert f"flashnext_spec_accepted_tokens_total {s.spec_accepted}" in text
    assert f"flashnext_spec_acceptance_rate {s.spec_accepted / s.spec_drafted:.6f}" in text
    length = (s.spec_accepted + s.spec_verify_steps) / s.spec_verify_steps
    assert f"flashnext_spec_mean_accepted_length {length:.6f}" in text
    assert "flashnext_spec_request_acceptance_rate_count 4" in text
    assert "flashnext_spec_request_mean_accepted_length_count 4" in text


def test_steps_scoring_drafts_are_verify_steps(model, monkeypatch):
    """The engine names a step scoring drafts `VERIFY` (the layers see what the step is); a run without drafts
    has prefill and decode steps only."""
    from flashnext.model.state import DECODE, PREFILL, VERIFY

    kinds = []
    inner = model.forward_step

    def recording(ids, step, *args, **kwargs):
        kinds.append(step.kind)
        return inner(ids, step, *args, **kwargs)

    monkeypatch.setattr(model, "forward_step", recording)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    _engine(model, 0).generate(PROMPTS[:3], params)
    assert set(kinds) == {PREFILL, DECODE}
    kinds.clear()
    engine = _engine(model, 3)
    KnownDrafts(engine, {}, p_wrong=0.0)
    engine.generate(PROMPTS[:3], params)
    assert VERIFY in kinds and engine.stats.spec_drafted > 0


# ---- the low-acceptance warning -------------------------------------------------------------------------------
def _low_acceptance_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "draft tokens were accepted" in r.getMessage()]


def test_an_untrained_head_warns_once_that_drafting_does_not_pay(model, caplog):
    """The random head's drafts are almost all rejected: after the first window of drafts one warning names the
    rate, the threshold and both ways out; the ~850 drafts after it (three more windows) warn no more."""
    engine = _engine(model, 3)
    with caplog.at_level(logging.WARNING, logger="flashnext.serve"):
        engine.generate(PROMPTS[:4], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    s = engine.stats
    assert s.spec_drafted >= 4 * s.acceptance_window and s.acceptance_rate < 0.1
    (line,) = _low_acceptance_warnings(caplog)
    window = re.search(r"\b\d+\.\d% of the last (\d+) draft tokens were accepted, below 10%", line)
    assert window and s.acceptance_window <= int(window[1]) < s.acceptance_window + 3  # whole verify steps of 3
    assert "--speculative-tokens 0" in line and "--train.mtp_loss_weight" in line


def test_drafts_that_are_mostly_right_do_not_warn(model, caplog):
    """Drafts of the plain continuation with 10% of tokens made wrong (acceptance ~0.8): no warning."""
    prompts, params = PROMPTS[:6], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    plain = _engine(model, 0).generate(prompts, params)
    engine = _engine(model, 3)
    KnownDrafts(engine, {tuple(p): o.token_ids for p, o in zip(prompts, plain, strict=True)}, p_wrong=0.1)
    with caplog.at_level(logging.WARNING, logger="flashnext.serve"):
        engine.generate(prompts, params)
    assert engine.stats.spec_drafted >= 2 * engine.stats.acceptance_window
    assert engine.stats.acceptance_rate > 0.5 and _low_acceptance_warnings(caplog) == []


def test_the_warning_takes_a_full_window_below_the_threshold(caplog):
    """A window of 256 drafts decides against the default 10%: 25 accepted (9.8%) warns, 26 (10.2%) does not;
    fewer drafts never warn."""
    with caplog.at_level(logging.WARNING, logger="flashnext.serve"):
        s = EngineStats()
        assert (s.low_acceptance, s.acceptance_window) == (0.1, 256)
        for _ in range(255):  # 255 drafts, none accepted: not a full window yet
            s.speculation(1, 0, 1)
        assert _low_acceptance_warnings(caplog) == []
        s = EngineStats()
        for i in range(128):  # 256 drafts in verify steps of 2
            s.speculation(2, int(i < 26), 0)
        assert _low_acceptance_warnings(caplog) == [] and not s.low_acceptance_warned
        for i in range(256):  # the next window: 25 of 256
            s.speculation(1, int(i < 25), 0)
        assert len(_low_acceptance_warnings(caplog)) == 1 and "9.8% of the last 256" in caplog.text
