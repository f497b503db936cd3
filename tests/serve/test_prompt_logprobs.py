"""Prompt log-probs (`SamplingParams.prompt_logprobs`) in the engine and completions `echo` on the server: what
lm-eval's loglikelihood and multiple-choice tasks are computed from.

The reference is one plain forward of the whole sequence (no serving state) in fp32. Serving computes the same
positions in prefill chunks beside other requests' decodes, so the values agree to float rounding (1e-5), not
bitwise; the top-n ids are compared where the reference's n-th and (n+1)-th log-probs are not a near tie.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_helpers import StepFault, running_server, small_model
from spec_helpers import KnownDrafts, spec_model

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import FieldError, SamplingParams
from flashnext.serve.server import build_app

TOL = 1e-5  # chunked prefill vs one full forward: fp32 rounding of a different summation order
TIE = 1e-4


def reference(model, ids: list[int]) -> torch.Tensor:
    """fp32 [L, V] log-probs of the token after each position, from one plain forward."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor(ids)).logits.float(), -1)


def check_table(model, ids: list[int], table: list, tops: list | None, n_top: int) -> None:
    ref = reference(model, ids)
    assert table[0] is None and len(table) == len(ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(torch.tensor(table[1:]), want, atol=TOL, rtol=0)
    if not n_top:
        return
    assert tops[0] == [] and all(len(t) == n_top for t in tops[1:])
    for p in range(1, len(ids)):
        vals, idx = ref[p - 1].topk(n_top + 1)
        got_ids = [t for t, _ in tops[p]]
        torch.testing.assert_close(torch.tensor([v for _, v in tops[p]]), vals[:n_top], atol=TOL, rtol=0)
        clear = [j for j in range(n_top) if all(abs(vals[j] - vals[i]) > TIE for i in range(n_top + 1) if i != j)]
        assert [got_ids[j] for j in clear] == [int(idx[j]) for j in clear]


@pytest.fixture(scope="module")
def model(small_config_module):
    return small_model(small_config_module)


PROMPTS = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(7 + n)).tolist() for n in (29, 5, 17, 2)]


def test_prompt_logprobs_in_chunks_beside_decodes(model):
    """Four prompts, a 12-token step budget (prompts prefill in chunks, beside the others' decodes), one request
    without prompt log-probs in the batch: every asked table equals the full forward's, and the generated tokens
    are those of a run that asked for nothing."""
    engine = Engine(model, None, max_slots=4, max_model_len=64, max_num_batched_tokens=12)
    asked = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=k) for k in (3, 0, 2)]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = engine.generate(PROMPTS, asked + [plain])
    base = engine.generate(PROMPTS, [plain] * 4)
    assert [o.token_ids for o in out] == [b.token_ids for b in base]
    for prompt, o, k in zip(PROMPTS, out, (3, 0, 2), strict=False):
        check_table(model, prompt, o.prompt_logprobs, o.prompt_top_logprobs, k)
    assert out[1].prompt_top_logprobs is None and out[3].prompt_logprobs is None


def test_prompt_logprobs_after_a_failed_step(model):
    """A step of several scored prompts fails once: they are recomputed one per step, their tables are rewritten
    by position (not appended to) and still equal the plain forward's."""
    engine = Engine(model, None, max_slots=4, max_model_len=64, max_num_batched_tokens=16)
    with StepFault(model, when=lambda ids, step: len(step.seg.cu_host) > 2, times=1) as fault:
        reqs = [engine.add_request(p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=1))
                for p in PROMPTS]  # fmt: skip
        while not all(r.finished for r in reqs):
            engine.step()
    assert fault.faults == 1 and all(r.finish_reason == "length" for r in reqs)
    for p, r in zip(PROMPTS, reqs, strict=True):
        check_table(model, p, r.prompt_logprobs, r.prompt_top_logprobs, 1)


def test_non_finite_prompt_logits_end_that_request_alone(model, monkeypatch):
    """A NaN at a scored prompt position is no score: that request ends with "error" naming the position; a
    request in the same steps runs on to the tokens it gives alone."""
    engine = Engine(model, None, max_slots=4, max_model_len=64, max_num_batched_tokens=64)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alone = engine.generate([PROMPTS[2]], greedy)[0].token_ids
    inner = model.forward_step

    def poisoned(ids, step, cache, inputs_embeds=None, **kw):
        out = inner(ids, step, cache, inputs_embeds=inputs_embeds, **kw)
        if "rows" in kw:  # the last asked row is the scored request's last prompt position
            out = out.clone()
            out[-1] = float("nan")
        return out

    monkeypatch.setattr(model, "forward_step", poisoned)
    scored = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0))
    other = engine.add_request(PROMPTS[2], greedy)
    while not (scored.finished and other.finished):
        engine.step()
    assert scored.finish_reason == "error" and f"prompt position(s) [{len(PROMPTS[0]) - 2}]" in scored.error
    assert other.finish_reason == "length" and other.output_ids == alone
    assert engine.cache.free_slots == engine.cache.max_slots


def test_max_tokens_zero_scores_the_prompt_only_and_choices_share_it(model):
    engine = Engine(model, None, max_slots=4, max_model_len=64, max_num_batched_tokens=8)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=0, n=2, prompt_logprobs=1))
    assert [o.token_ids for o in out] == [[], []] and {o.finish_reason for o in out} == {"length"}
    for o in out:
        check_table(model, PROMPTS[0], o.prompt_logprobs, o.prompt_top_logprobs, 1)
    assert engine.cache.free_slots == engine.cache.max_slots
    with pytest.raises(FieldError, match="max_tokens must be an integer >= 1, got 0"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=0))


def test_prompt_logprobs_beside_speculating_requests(small_config_module):
    """A speculative verify step (drafts verified in the same stream) that also carries a prompt to score."""
    model = spec_model(small_config_module)
    engine = Engine(model, None, max_slots=4, max_model_len=96, max_num_batched_tokens=16, num_speculative_tokens=3)
    truth = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0.0, num_speculative_tokens=0))
    KnownDrafts(engine, {tuple(PROMPTS[1]): truth[0].token_ids}, p_wrong=0.2)
    spec = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0))
    for _ in range(3):
        engine.step()
    scored = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    while not (spec.finished and scored.finished):
        engine.step()
    assert engine.stats.spec_verify_steps > 0 and spec.output_ids == truth[0].token_ids
    check_table(model, PROMPTS[0], scored.prompt_logprobs, scored.prompt_top_logprobs, 2)


# ---- the server: completions echo, as lm-eval's local-completions model sends it ----------------------------------
@pytest.fixture(scope="module")
def server():
    model, tok, name = load_for_serving(None)
    engine = Engine(model, tok, max_slots=8, max_model_len=96, max_num_batched_tokens=24)
    with running_server(build_app(engine, name)) as base:
        yield base, name, model, tok


def _post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_lm_eval_loglikelihood_equals_the_models_own_logprobs(server):
    """lm-eval's request for a batch of (context, continuation) pairs: token-id prompts, echo, logprobs 1,
    max_tokens 1, temperature 0. Its loglikelihood (the sum of `token_logprobs[ctxlen:-1]`) and greedy flag (each
    continuation token's log-prob equals its position's top) computed from the answer equal the model's own."""
    base, name, model, tok = server
    pairs = [("The cat sat on", " the mat"), ("Hello", " world and more"), ("A", " b")]
    prompts = [tok.encode(c) + tok.encode(x) for c, x in pairs]
    ctxlens = [len(tok.encode(c)) for c, _ in pairs]
    body = {"model": name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}  # fmt: skip
    out = _post(base, body)
    assert out.status_code == 200, out.text
    choices = sorted(out.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    for ids, ctxlen, c in zip(prompts, ctxlens, choices, strict=True):
        lp = c["logprobs"]
        assert lp["token_ids"][: len(ids)] == ids and len(lp["token_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(model, ids)
        want = ref[torch.arange(ctxlen - 1, len(ids) - 1), torch.tensor(ids[ctxlen:])]
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(float(want.sum()), abs=TOL)
        greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][ctxlen:-1],
                                                            lp["top_logprobs"][ctxlen:-1], strict=True))  # fmt: skip
        assert greedy == bool((ref[ctxlen - 1 : len(ids) - 1].argmax(-1) == torch.tensor(ids[ctxlen:])).all())
        assert c["text"].startswith(tok.decode(ids))


def test_echo_text_offsets_and_max_tokens_zero(server):
    base, name, model, tok = server
    out = _post(base, {"model": name, "prompt": "The cat sat", "echo": True, "max_tokens": 0, "logprobs": 2})
    assert out.status_code == 200, out.text
    c = out.json()["choices"][0]
    ids = tok.encode("The cat sat")
    assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length" and c["token_ids"] == []
    lp = c["logprobs"]
    assert lp["token_ids"] == ids and len(lp["text_offset"]) == len(ids)
    assert lp["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert all(len(t) <= 2 for t in lp["top_logprobs"][1:])
    # echo with a completion: the completion's offsets continue after the prompt
    out = _post(base, {"model": name, "prompt": "The cat sat", "echo": True, "max_tokens": 5, "temperature": 0,
                       "logprobs": 0, "ignore_eos": True}).json()["choices"][0]  # fmt: skip
    full = ids + out["token_ids"]
    assert out["logprobs"]["text_offset"] == [len(tok.decode(full[:i])) for i in range(len(full))]
    assert out["text"] == tok.decode(ids) + tok.decode(out["token_ids"])
    # without echo, offsets are into the completion's own text, and max_tokens 0 is refused
    plain = _post(base, {"model": name, "prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 0}).json()
    ch = plain["choices"][0]
    assert ch["logprobs"]["text_offset"] == [len(tok.decode(ch["token_ids"][:i])) for i in range(4)]
    bad = _post(base, {"model": name, "prompt": "Hi", "max_tokens": 0})
    assert bad.status_code == 400 and "0 is allowed with echo" in bad.json()["error"]["message"]


def test_batched_prompts_with_n_choices_and_streamed_echo(server):
    base, name, _, tok = server
    body = {"model": name, "prompt": ["One two", "Three"], "n": 2, "max_tokens": 3, "temperature": 0}
    out = _post(base, body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    singles = [_post(base, {**body, "prompt": p, "n": 1}).json()["choices"][0]["text"] for p in body["prompt"]]
    assert [c["text"] for c in out["choices"]] == [singles[0]] * 2 + [singles[1]] * 2
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(tok.encode("One two")) + len(tok.encode("Three"))
    assert usage["completion_tokens"] == 12
    bad = _post(base, {**body, "prompt": [[1, 2], [1, 10**9]]})
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("prompt[1]: ")
    # streamed echo: each choice's first chunk starts with its prompt; the texts add up to the whole answer's
    whole = _post(base, {**body, "echo": True, "logprobs": 0}).json()
    texts, tokens = [""] * 4, [[] for _ in range(4)]
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "echo": True, "logprobs": 0, "stream": True},
                      timeout=60) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] += ch["text"]
                    tokens[ch["index"]] += ch["logprobs"]["token_ids"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert tokens == [c["logprobs"]["token_ids"] for c in whole["choices"]]


def test_top_logprobs_keep_the_higher_ranked_of_tokens_with_one_text(server):
    """Two ids that decode to the same text (byte tokens of a split character all read U+FFFD): the dict keeps
    the better-ranked log-prob (it kept the last, lower one), so `max(top.values())` is still the top-1's."""
    from flashnext.serve.formatting import Formatter

    _, _, _, tok = server
    a, b = 99, 100
    assert tok.decode([a], skip_special_tokens=False) == tok.decode([b], skip_special_tokens=False) == "\ufffd"
    cat = tok.encode("cat")[0]
    fmt = Formatter("x", "m", tok, [], chat=False)
    top = fmt._top([(a, -0.5), (cat, -1.0), (b, -2.0)])
    assert top == {"\ufffd": -0.5, tok.decode([cat], skip_special_tokens=False): -1.0}


def test_text_offsets_of_split_characters(server):
    """Byte-level tokens that split a character: every offset is a place in the decoded text, the pieces of a
    character start where it does, and offsets never go back."""
    from flashnext.serve.formatting import Formatter

    _, _, _, tok = server
    ids = tok.encode("naïve 😀 wörld, 漢字!")
    assert "".join(tok.decode([t]) for t in ids) != tok.decode(ids)  # some token really splits a character
    offsets = Formatter("x", "m", tok, [], chat=False)._offsets(ids, 3)
    assert offsets == sorted(offsets) and offsets[0] == 3
    assert offsets == [3 + len(tok.decode(ids[:k]).rstrip("\ufffd")) for k in range(len(ids))]
