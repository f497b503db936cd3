"""Penalties and logit controls (`serve.logit_controls`): the batched path against a plain per-token reference
written here from the formulas, the engine honouring each field (eager, decode graph, n choices, speculation), and
the server's routes taking them or refusing bad values with a 400 naming the field.

Bitwise where bitwise by construction: the controls are elementwise fp32 operations done in the same order as the
reference's (`x + b`, `x / r` or `x * r`, `x - f * c`, `x - p`), so a controlled row equals the reference exactly
and an uncontrolled row is `logits.float()` itself. Greedy runs through the model are compared token for token,
with a divergence allowed only at a near tie (`spec_helpers.TIE`): an incremental step and a full forward differ
by float rounding.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import torch
from serve_helpers import running_server
from spec_helpers import TIE, KnownDrafts, compare_greedy, run_mixed, spec_model

from flashnext.logprobs import temperature_logprobs
from flashnext.serve.engine import Engine
from flashnext.serve.loading import end_of_turn_ids, load_for_serving
from flashnext.serve.logit_controls import LogitControls
from flashnext.serve.request import Request
from flashnext.serve.sampler import Sampler
from flashnext.serve.sampling import FieldError, SamplingParams, target_probs
from flashnext.serve.server import build_app

F32 = torch.float32


# ---- the plain reference ----------------------------------------------------------------------------------------
def reference(x: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, eos: int | None):
    """One row [V] controlled token by token, as the module doc of `serve.logit_controls` writes the formulas."""
    x = x.float().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] = x[t] + torch.tensor(b, dtype=F32)
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | ({eos} if eos is not None and not p.ignore_eos else set()):
            x[t] = float("-inf")
    if p.repetition_penalty != 1.0:
        r = torch.tensor(p.repetition_penalty, dtype=F32)
        for t in set(prompt) | set(output):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(output).items():
        if p.frequency_penalty or p.presence_penalty:
            x[t] = x[t] - torch.tensor(p.frequency_penalty, dtype=F32) * c
            x[t] = x[t] - torch.tensor(p.presence_penalty, dtype=F32)
    return x


def _random_params(gen: torch.Generator, V: int) -> SamplingParams:
    """Some controls on or off at random (a quarter of the rows plain), values across their ranges."""
    u = lambda: float(torch.rand((), generator=gen))  # noqa: E731
    if u() < 0.25:
        return SamplingParams(temperature=0.0)
    bias = {int(t): round(200 * u() - 100, 3) for t in torch.randint(0, V, (3,), generator=gen)} if u() < 0.5 else None
    return SamplingParams(
        temperature=0.0, max_tokens=50, logit_bias=bias, min_tokens=int(6 * u()),
        stop_token_ids=[3] if u() < 0.5 else [], repetition_penalty=[1.0, 0.7, 1.3][int(3 * u())],
        frequency_penalty=round(4 * u() - 2, 3) if u() < 0.7 else 0.0,
        presence_penalty=round(4 * u() - 2, 3) if u() < 0.7 else 0.0, ignore_eos=u() < 0.3,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_batched_path_equals_the_per_token_reference(dtype):
    """12 requests over 6 steps, each step a batch of a random subset (requests finish and new ones take their
    table rows): every controlled row equals the reference bitwise, every plain row is `logits.float()`; the counts
    follow each request's output incrementally. Half the steps add draft tokens ahead of the output (`extras`, the
    speculative verify rows), which count as generated."""
    V, eos, gen = 40, 2, torch.Generator().manual_seed(0)
    ctl = LogitControls(eos)
    reqs = [Request(f"r{i}", torch.randint(0, V, (5,), generator=gen).tolist(), _random_params(gen, V))
            for i in range(12)]  # fmt: skip
    for step in range(6):
        live = [r for r in reqs if not r.finished]
        batch = [live[int(i)] for i in torch.randperm(len(live), generator=gen)[: min(8, len(live))]]
        extras = [torch.randint(0, V, (int(torch.randint(0, 4, (), generator=gen)),), generator=gen).tolist()
                  for _ in batch] if step % 2 else None  # fmt: skip
        logits = (torch.randn(len(batch), V, generator=gen) * 3).to(dtype)
        out = ctl.apply(logits, batch, extras)
        for i, r in enumerate(batch):
            extra = extras[i] if extras else []
            want = reference(logits[i], r.prompt_ids, r.output_ids + extra, r.params, eos)
            assert torch.equal(out[i], want), (step, i, r.params)
        for r in batch:
            r.output_ids += torch.randint(0, V, (int(torch.randint(1, 3, (), generator=gen)),), generator=gen).tolist()
        if step == 2:
            for r in live[:5]:
                r.finish_reason = "length"
    assert ctl.counts.shape[0] <= 16  # finished requests' rows were reused


def test_a_batch_without_controls_costs_nothing():
    logits = torch.randn(3, 10)
    reqs = [Request(str(i), [1, 2], SamplingParams(min_p=0.5)) for i in range(3)]
    assert LogitControls(0).apply(logits, reqs) is logits


def test_plain_rows_of_a_mixed_batch_are_untouched():
    """The sampler on a batch mixing plain and controlled rows (greedy and seeded): the plain rows' tokens and
    log-probs are bitwise those of the same rows sampled without the controlled ones; a controlled row reports
    "processed" log-probs of the controlled logits at its temperature, "raw" ones of the model's logits."""
    V, gen = 64, torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen) * 2
    plain = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, seed=4, logprobs=2),
             SamplingParams(temperature=1.2, seed=5, logprobs=0, logprobs_mode="processed")]  # fmt: skip
    controlled = [SamplingParams(temperature=0.7, seed=6, logprobs=1, logprobs_mode="processed", frequency_penalty=1.5,
                                 presence_penalty=-0.5, repetition_penalty=1.4, logit_bias={5: 9.0}),
                  SamplingParams(temperature=0.0, logprobs=0, min_tokens=3, logit_bias={2: 100.0}),
                  SamplingParams(temperature=0.8, seed=7, logprobs=0, min_p=0.2, repetition_penalty=0.8)]  # fmt: skip

    def requests(params):
        reqs = [Request(str(i), [7, 8, 9], p, generator=torch.Generator().manual_seed(p.seed or 0))
                for i, p in enumerate(params)]  # fmt: skip
        for r in reqs:
            r.output_ids = [7, 5, 5, 11]
        return reqs

    order = [0, 3, 1, 4, 2, 5]  # plain rows 0, 2, 4
    mixed = requests([(plain + controlled)[k] for k in order])
    tokens, chosen, top, _ = Sampler(None, 2, 100).sample(logits, mixed)
    alone_t, alone_c, alone_top, _ = Sampler(None, 2, 100).sample(logits[[0, 2, 4]], requests(plain))
    assert [tokens[i] for i in (0, 2, 4)] == alone_t and [chosen[i] for i in (0, 2, 4)] == alone_c
    assert torch.equal(top.values[[0, 2, 4], :2], alone_top.values) and torch.equal(top.indices[[0, 2, 4], :2],
                                                                                    alone_top.indices)  # fmt: skip
    want = temperature_logprobs(reference(logits[1], [7, 8, 9], [7, 5, 5, 11], controlled[0], 2)[None], 0.7)[0]
    assert chosen[1] == want[tokens[1]].item()
    # min_tokens 3 with 4 generated: EOS is free again (+100 makes it win); its raw log-prob is the model's
    assert tokens[3] == 2 and chosen[3] == torch.log_softmax(logits[3], -1)[2].item()


def test_min_p_keeps_the_tokens_the_formula_keeps():
    """`min_p` (after temperature and top-k, before top-p): kept tokens are those with p >= min_p * p_max, the
    kept weights are the softmax renormalised over them (fp32 exp rounding: 1e-6)."""
    gen = torch.Generator().manual_seed(2)
    for min_p, top_k, T in [(0.05, 0, 1.0), (0.3, 0, 0.6), (0.1, 12, 1.4), (1.0, 0, 1.0)]:
        row = torch.randn(200, generator=gen) * 2
        p = SamplingParams(temperature=T, top_k=top_k, min_p=min_p)
        probs = torch.softmax(row.double() / T, -1)
        keep = probs >= min_p * probs.max()
        if top_k:
            keep &= row >= torch.topk(row, top_k).values[-1]
        want = torch.where(keep, probs, 0.0)
        got = target_probs(row, row.max(), p)
        torch.testing.assert_close(got.double() / got.sum(), want / want.sum(), atol=1e-6, rtol=0)
        assert torch.equal(got > 0, keep)


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # more than max_tokens (16)
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": True}, "min_p"),
]


@pytest.mark.parametrize(("fields", "name"), BAD, ids=[f"{n}={v!r}" for (f, n) in BAD for v in f.values()])
def test_bad_values_are_refused_naming_the_field(fields, name):
    with pytest.raises(FieldError) as e:
        SamplingParams(**fields).validate()
    assert e.value.field == name and name in str(e.value)


# ---- the engine ---------------------------------------------------------------------------------------------------
PROMPT = list(range(30, 42))


@pytest.fixture(scope="module")
def tiny():
    model, tok, name = load_for_serving(None)
    return model, tok, name


def _greedy(**controls) -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=2, **controls)


def _reference_decode(model, prompt: list[int], p: SamplingParams, eos: int, n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forwards (no serving state) with the reference controls: (tokens, top-2 gaps)."""
    out, gaps = [], []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor(prompt + out)).logits[-1]
        x = reference(row, prompt, out, p, eos)
        top2 = torch.topk(x, 2).values
        gaps.append(float(top2[0] - top2[1]))
        out.append(int(x.argmax()))
    return out, gaps


def _same_up_to_ties(got: list[int], want: list[int], gaps: list[float]) -> None:
    at = next((j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert at is None or gaps[at] <= TIE, f"diverges at {at}: {got[at]} vs {want[at]} (gap {gaps[at]:.3g})"


def test_frequency_and_presence_penalties_follow_the_reference(tiny):
    """Greedy for 60 tokens the tiny model loops (many repeats); with frequency and presence penalties it
    repeats less, and its tokens are those of the reference decoder (full forward + the formulas, argmax)."""
    model, tok, _ = tiny
    engine = Engine(model, tok, max_slots=4, max_model_len=128)
    p = _greedy(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1)
    none, pen = engine.generate([PROMPT, PROMPT], [_greedy(), p])
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(pen.token_ids) < repeats(none.token_ids) and repeats(none.token_ids) > 10
    want, gaps = _reference_decode(model, PROMPT, p, tok.eos_token_id, 60)
    _same_up_to_ties(pen.token_ids, want, gaps)


def test_logit_bias_forces_and_bans_tokens(tiny):
    model, tok, _ = tiny
    engine = Engine(model, tok, max_slots=4, max_model_len=128)
    plain = engine.generate([PROMPT], _greedy())[0].token_ids
    forced, sampled, banned = engine.generate([PROMPT] * 3, [
        _greedy(logit_bias={7: 100.0}),
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True, logit_bias={9: 100.0}),
        _greedy(logit_bias={plain[0]: -100.0, plain[1]: -100.0}),
    ])  # fmt: skip
    assert forced.token_ids == [7] * 60 and sampled.token_ids == [9] * 20
    assert plain[0] not in banned.token_ids and plain[1] not in banned.token_ids


def test_min_tokens_blocks_eos_and_stop_ids(tiny):
    """EOS (and a stop id) pushed to the top by logit_bias: blocked until min_tokens tokens, then it ends."""
    model, tok, _ = tiny
    eos = tok.eos_token_id
    engine = Engine(model, tok, max_slots=4, max_model_len=128)
    free, held, stop_id = engine.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0}),
        SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=5),
        SamplingParams(max_tokens=20, temperature=0.7, seed=1, logit_bias={11: 100.0}, stop_token_ids=[11],
                       min_tokens=4),
    ])  # fmt: skip
    assert free.token_ids == [eos] and free.finish_reason == "stop"
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    assert held.finish_reason == "stop"
    assert len(stop_id.token_ids) == 5 and stop_id.token_ids[4] == 11 and stop_id.finish_reason == "stop"


def test_a_bf16_engine_takes_the_controls():
    """bf16 logits are controlled in fp32 (the unit test above holds the values): the penalties cut the greedy
    loop's repeats, +100 forces a token, min_tokens holds EOS back."""
    model, tok, _ = load_for_serving(None, dtype=torch.bfloat16)
    engine = Engine(model, tok, max_slots=4, max_model_len=128)
    eos = tok.eos_token_id
    none, pen, forced, held = engine.generate([PROMPT] * 4, [
        _greedy(), _greedy(frequency_penalty=0.5, presence_penalty=0.5), _greedy(logit_bias={7: 100.0}),
        SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=3),
    ])  # fmt: skip
    repeats = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert repeats(pen.token_ids) < repeats(none.token_ids)
    assert forced.token_ids == [7] * 60 and held.token_ids[3:] == [eos] and eos not in held.token_ids[:3]


MIXED = [_greedy(frequency_penalty=0.5), _greedy(), _greedy(presence_penalty=1.0, repetition_penalty=1.3),
         _greedy(logit_bias={7: 3.0, 8: -2.0}, min_tokens=10, frequency_penalty=-0.3)]  # fmt: skip


def test_decode_graph_and_n_choices_take_the_controls(tiny):
    """The compiled decode step returns logits; the controls apply after it: a mixed batch gives the eager
    engine's tokens (as `test_decode_graph` holds the plain ones). n = 3 greedy penalised choices each give the
    single request's tokens."""
    model, tok, _ = tiny
    kwargs = dict(max_slots=4, max_model_len=128, max_num_batched_tokens=64)
    eager = Engine(model, tok, **kwargs).generate([PROMPT] * 4, MIXED)
    engine = Engine(model, tok, **kwargs, decode_graph=True, decode_buckets=[4], compile_backend="eager")
    graph = engine.generate([PROMPT] * 4, MIXED)
    assert engine.decode_graph.compiles > 0
    assert [c.token_ids for c in graph] == [c.token_ids for c in eager]
    three = Engine(model, tok, **kwargs).generate([PROMPT], [SamplingParams(**{**vars(MIXED[2]), "n": 3})])
    assert [c.token_ids for c in three] == [eager[2].token_ids] * 3


# ---- speculation -------------------------------------------------------------------------------------------------
SPEC_PROMPTS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17, 5)]


@pytest.fixture(scope="module")
def mtp_model(small_config_module):
    return spec_model(small_config_module)


def _spec_params(k_off_first: bool = True) -> list[SamplingParams]:
    """Penalised and plain greedy requests (the first does not speculate); ignore EOS, 40 tokens."""
    controls = [dict(frequency_penalty=0.6, presence_penalty=0.3), {}, dict(repetition_penalty=1.5, min_tokens=8,
                logit_bias={1: 2.0}), dict(frequency_penalty=-0.4, logit_bias={3: -5.0})]  # fmt: skip
    return [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2, **c,
                           num_speculative_tokens=0 if i == 0 and k_off_first else None)
            for i, c in enumerate(controls)]  # fmt: skip


@pytest.mark.parametrize("drafts", ["known", "head"])
def test_speculation_gives_the_plain_tokens_with_controls(mtp_model, drafts):
    """k = 3, mixed penalised and plain requests joining in waves: every token equals the run without
    speculation (near ties aside); with known drafts (some wrong) full, partial and no acceptance all happen, so
    the per-position counts of accepted and rejected drafts are exercised."""
    kw = dict(max_slots=4, max_model_len=80, max_num_batched_tokens=32)
    plain = run_mixed(Engine(mtp_model, None, **kw), SPEC_PROMPTS, _spec_params(), [0, 3])
    engine = Engine(mtp_model, None, **kw, num_speculative_tokens=3)
    if drafts == "known":
        KnownDrafts(engine, {tuple(p): r.output_ids for p, r in zip(SPEC_PROMPTS, plain, strict=True)}, p_wrong=0.3)
    spec = run_mixed(engine, SPEC_PROMPTS, _spec_params(), [0, 3])
    print("near-tie divergences", compare_greedy(plain, spec))
    assert engine.stats.spec_verify_steps > 0 and spec[0].num_drafted == 0
    if drafts == "known":
        assert 0.3 < engine.stats.acceptance_rate < 0.95


def test_sampled_speculation_reports_the_penalised_target(mtp_model):
    """Seeded sampling with k = 3 and penalties: every emitted token's "processed" log-prob is the reference's,
    from a full forward over prompt + the tokens before it, controlled and tempered (1e-4: fp32 rounding of the
    verify step vs a full forward); accepted drafts, resampled and bonus tokens all report through `verify`."""
    engine = Engine(mtp_model, None, max_slots=4, max_model_len=80, num_speculative_tokens=3)
    p = SamplingParams(max_tokens=30, temperature=0.8, seed=2, ignore_eos=True, logprobs=0, logprobs_mode="processed",
                       frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.2, logit_bias={4: 1.5},
                       min_tokens=5, stop_token_ids=[6])  # fmt: skip
    prompt = SPEC_PROMPTS[2]
    KnownDrafts(engine, {}, p_wrong=0.0)  # drafts of token 0: accepted only when the target samples 0
    out = engine.generate([prompt], p)[0]
    assert out.num_verify_steps > 0
    ids = torch.tensor(prompt + out.token_ids)
    with torch.no_grad():
        logits = mtp_model(ids).logits
    want = []
    for j, tok in enumerate(out.token_ids):
        x = reference(logits[len(prompt) - 1 + j], prompt, out.token_ids[:j], p, None)
        want.append(temperature_logprobs(x[None], 0.8)[0, tok].item())
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want), atol=1e-4, rtol=0)


# ---- the server ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny):
    model, tok, name = tiny
    engine = Engine(model, tok, max_slots=4, max_model_len=128, max_num_batched_tokens=64)
    with running_server(build_app(engine, name)) as base:
        yield base, name, engine, tok


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def test_the_routes_honour_each_field(server):
    """Completions, chat and the token route: the same tokens as the engine with the same params."""
    base, name, engine, tok = server
    controls = {"presence_penalty": 0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.2, "min_p": 0.05,
                "logit_bias": {"7": 4.0, "8": -3.0}, "min_tokens": 3}  # fmt: skip
    alone = Engine(engine.model, tok, max_slots=4, max_model_len=128)  # the server's engine is its loop's alone
    want = alone.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, **{
        **controls, "logit_bias": {7: 4.0, 8: -3.0}}))[0].token_ids  # fmt: skip
    body = {"model": name, "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, **controls}
    r = _post(base, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    r = _post(base, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 30, "temperature": 0, "ignore_eos": True, **controls}})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    end = end_of_turn_ids(tok)[0]
    chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 12,
            "logit_bias": {str(end): 100}, "min_tokens": 4}  # fmt: skip
    r = _post(base, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "stop"
    chat.pop("max_tokens")  # no limit: min_tokens is checked against the context, not a placeholder
    assert _post(base, "/v1/chat/completions", chat).json()["usage"]["completion_tokens"] == 5


ROUTE_BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "'x'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "101"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "999999"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens=4"),
    ({"min_p": 1.5}, "min_p", "1.5"),
    ({"min_p": "lots"}, "min_p", "lots"),
]


@pytest.mark.parametrize("route", ["completions", "chat", "token"])
@pytest.mark.parametrize(("patch", "field", "needle"), ROUTE_BAD, ids=[f"{f}-{n}" for _, f, n in ROUTE_BAD])
def test_bad_values_are_a_400_naming_the_field(server, route, patch, field, needle):
    base, name, engine, _ = server
    before = engine.stats.finished
    if route == "token":
        path, body = "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": patch}
        field = f"sampling_params.{field}"
    elif route == "chat":
        path, body = "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "hi"}], **patch}
    else:
        path, body = "/v1/completions", {"model": name, "prompt": PROMPT, **patch}
    r = _post(base, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and field.rsplit(".", 1)[-1] in err["message"], err
    assert err["param"] == field or (route, needle) == ("token", "999999") and err["param"] == "logit_bias", err
    assert not engine.has_unfinished() and engine.stats.finished == before  # nothing was queued
