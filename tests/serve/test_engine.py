"""Engine behaviour on the tiny default model (bundled tokenizer): stops, abort, seeds, top-k, the CLI."""

from __future__ import annotations

import pytest
import torch

from flashnext.cli import main as cli_main
from flashnext.errors import InputError
from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_for_serving(None)


@pytest.fixture
def engine(loaded):
    model, tok, _ = loaded
    return Engine(model, tok, max_slots=4, max_model_len=64, max_num_batched_tokens=32)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_stop_token_ids_and_strings(engine):
    base = engine.generate(["The cat"], SamplingParams(max_tokens=12, **GREEDY))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = engine.generate(["The cat"], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    text = base.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    out = engine.generate(["The cat"], SamplingParams(max_tokens=12, stop=[needle], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(needle)]


def test_seeded_sampling_independent_of_batch(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    alone = engine.generate(["Hello"], params)[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True)
    batched = engine.generate(["Hi there friend", "Hello", "Bye"], [others, params, others])[1].token_ids
    assert batched == alone
    top1 = engine.generate(["Hello"], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=3, ignore_eos=True))
    assert top1[0].token_ids == engine.generate(["Hello"], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids


def test_abort_frees_slot(engine):
    req = engine.add_request("Hello", SamplingParams(max_tokens=50, **GREEDY))
    for _ in range(3):
        engine.step()
    assert req.slot is not None and len(req.output_ids) > 0
    engine.abort(req.request_id)
    engine.step()
    assert req.finish_reason == "abort" and req.slot is None
    assert engine.cache.free_slots == engine.cache.max_slots and not engine.has_unfinished()


def test_impossible_requests_rejected(engine):
    with pytest.raises(InputError, match="max_tokens"):
        engine.add_request("x", SamplingParams(max_tokens=0))
    with pytest.raises(InputError, match="vocabulary"):
        engine.add_request([1, 10**6])
    with pytest.raises(InputError, match="max_model_len"):
        engine.add_request([5] * 64)


def test_generate_cli(capsys):
    assert cli_main(["generate", "--ids", "5,6,7", "--max-tokens", "4", "--threads", "1"]) == 0
    out = capsys.readouterr()
    assert "4 tokens" in out.err and "finish_reason=length" in out.err


def test_sampler_skips_logprobs_only_when_asked():
    """`sample(..., with_logprobs=False)` picks the same tokens and computes no log-probs."""
    from flashnext.serve.sampling import sample

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=1)] * 2
    gens = [None, torch.Generator().manual_seed(3)] * 2
    tokens, logprobs = sample(logits, params, [None if g is None else g.clone_state() for g in gens])
    tokens2, none = sample(logits, params, [None if g is None else g.clone_state() for g in gens], False)
    assert none is None and torch.equal(tokens, tokens2)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1))


@pytest.mark.parametrize("budget", [32, 4], ids=["one-chunk", "chunked"])
def test_n_choices_share_one_prefill(loaded, budget):
    """n choices prefill the prompt once (counted in the stats) and then equal n separate requests: greedy gives
    n identical completions, sampled choice i equals a request seeded with `choice_seed(seed, i)`."""
    from flashnext.serve.sampling import choice_seed

    model, tok, _ = loaded
    engine = Engine(model, tok, max_slots=4, max_model_len=64, max_num_batched_tokens=budget)
    prompt = "The quick brown fox jumps"
    n_prompt = len(engine.encode(prompt))
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
    before = engine.stats.prompt_tokens
    outs = engine.generate([prompt], SamplingParams(max_tokens=8, n=3, **GREEDY))
    assert engine.stats.prompt_tokens - before == n_prompt
    assert [o.index for o in outs] == [0, 1, 2] and all(o.token_ids == greedy for o in outs)

    sampled = dict(max_tokens=8, temperature=1.0, top_p=0.95, ignore_eos=True)
    before = engine.stats.prompt_tokens
    outs = engine.generate([prompt], SamplingParams(n=3, seed=5, **sampled))
    assert engine.stats.prompt_tokens - before == n_prompt
    alone = [engine.generate([prompt], SamplingParams(seed=choice_seed(5, i), **sampled))[0] for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # the choices differ
    assert engine.cache.free_slots == engine.cache.max_slots


def test_n_choices_abort_and_limits(engine):
    group = engine.add_request("Hello", SamplingParams(max_tokens=30, n=3, **GREEDY))
    for _ in range(3):
        engine.step()
    assert all(len(c.output_ids) > 0 for c in group.choices)
    engine.abort(group.request_id)
    engine.step()
    assert [c.finish_reason for c in group.choices] == ["abort"] * 3
    assert engine.cache.free_slots == engine.cache.max_slots and not engine.has_unfinished()
    with pytest.raises(InputError, match="n=5 exceeds max_slots=4"):
        engine.add_request("x", SamplingParams(n=5))


def test_degenerate_sampling_values_are_served(engine):
    """temperature 1e-45 is greedy; top_p 1e-300 keeps the top token (greedy too): neither fails a request."""
    greedy = engine.generate(["Hello"], SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
    tiny_t = SamplingParams(max_tokens=10, temperature=1e-45, ignore_eos=True, seed=1)
    tiny_p = SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-300, ignore_eos=True, seed=1)
    outs = engine.generate(["Hello", "Hello"], [tiny_t, tiny_p])
    assert [o.token_ids for o in outs] == [greedy, greedy] and {o.finish_reason for o in outs} == {"length"}
