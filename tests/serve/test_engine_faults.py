"""One request's failure never ends another: faults injected into the model for one request only.

The innocent requests' greedy tokens must equal an undisturbed run. After a failed step they are recomputed (a
different chunking and batch composition than the undisturbed run), so their log-probs match to float rounding
only (1e-4), not bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import StepFault

from flashnext.serve.engine import Engine
from flashnext.serve.loading import load_for_serving
from flashnext.serve.sampling import SamplingParams

INNOCENT = [[10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_for_serving(None)


def _engine(model, tok) -> Engine:
    return Engine(model, tok, max_slots=4, max_model_len=64, max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def reference(loaded):
    """The innocent requests run undisturbed, and a marker id that none of them feeds or generates."""
    model, tok, _ = loaded
    outs = _engine(model, tok).generate(INNOCENT, PARAMS)
    used = {t for o in outs for t in o.token_ids} | {t for p in INNOCENT for t in p}
    return outs, next(t for t in range(5, 512) if t not in used)


def _run(engine, culprit: list[int] | None, params=PARAMS, warmup: int = 3):
    """Start the innocent requests, step a little, add the culprit (if any), run everything to the end."""
    reqs = [engine.add_request(p, params) for p in INNOCENT]
    for _ in range(warmup):
        engine.step()
    bad = engine.add_request(culprit, params) if culprit is not None else None
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "the engine did not finish its requests"
    assert engine.cache.free_slots == engine.cache.max_slots
    return reqs, bad


def _assert_untouched(reqs, ref) -> None:
    for req, want in zip(reqs, ref, strict=True):
        assert req.finish_reason == "length" and req.error is None
        assert req.output_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(req.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("where", ["first-chunk", "later-chunk"])
def test_forward_failure_ends_only_the_culprit(loaded, reference, where):
    """The model raises whenever the culprit's marker token is in a step (its prompt's first chunk, or its second
    chunk after a clean first one): the culprit ends with "error"; the innocents, in the failed steps with it, are
    recomputed and finish exactly as undisturbed."""
    model, tok, _ = loaded
    ref, marker = reference
    culprit = [marker, 5, 6] if where == "first-chunk" else [5] * 10 + [marker]
    with StepFault(model, marker) as fault:
        engine = _engine(model, tok)
        reqs, bad = _run(engine, culprit)
    assert bad.finish_reason == "error" and "injected fault" in bad.error and bad.output_ids == []
    _assert_untouched(reqs, ref)
    assert fault.faults == engine.stats.failed_steps == 2  # once with the innocents, once alone
    assert engine.stats.recomputed_tokens > 0


def test_transient_failure_ends_nobody(loaded, reference):
    """A step of several requests fails once (not because of any one request): every request is recomputed
    alone, passes, and finishes exactly as undisturbed."""
    model, tok, _ = loaded
    ref, _ = reference
    with StepFault(model, when=lambda ids, step: len(step.seg.lengths) > 1, times=1) as fault:
        engine = _engine(model, tok)
        reqs, _ = _run(engine, None)
    assert fault.faults == engine.stats.failed_steps == 1
    _assert_untouched(reqs, ref)


def test_failure_of_a_lone_request(loaded, reference):
    """A request that fails alone ends with "error" at once; the engine serves the next request normally."""
    model, tok, _ = loaded
    ref, marker = reference
    with StepFault(model, marker):
        engine = _engine(model, tok)
        bad = engine.add_request([marker, 7], PARAMS)
        engine.step()
        assert bad.finish_reason == "error" and engine.cache.free_slots == engine.cache.max_slots
        assert engine.generate(INNOCENT[:1], PARAMS)[0].token_ids == ref[0].token_ids


def test_non_finite_logits_end_only_their_request(loaded, reference):
    """NaN logits for the culprit's row: it ends with "error" naming them; the rows beside it sample on."""
    model, tok, _ = loaded
    ref, marker = reference
    with StepFault(model, marker, mode="nan"):
        engine = _engine(model, tok)
        reqs, bad = _run(engine, [marker, 5, 6])
    assert bad.finish_reason == "error" and "not finite" in bad.error
    _assert_untouched(reqs, ref)
    assert engine.stats.failed_steps == 0


def test_n_choices_fail_together_before_their_fork(loaded, reference):
    """A culprit with n=3 fails during its prompt: its 3 choices end with "error", slots freed; innocents go on."""
    model, tok, _ = loaded
    ref, marker = reference
    with StepFault(model, marker):
        engine = _engine(model, tok)
        reqs = [engine.add_request(p, PARAMS) for p in INNOCENT[:1]]
        engine.step()
        group = engine.add_request([marker, 5], SamplingParams(max_tokens=4, temperature=0.0, n=3))
        while engine.has_unfinished():
            engine.step()
    assert [c.finish_reason for c in group.choices] == ["error"] * 3
    assert engine.cache.free_slots == engine.cache.max_slots
    _assert_untouched(reqs, ref[:1])


def test_failing_update_callback_cancels_only_its_request(loaded, reference):
    """A client callback that raises (its client is gone) cancels that request; the others are untouched."""
    model, tok, _ = loaded
    ref, _ = reference

    def broken(req):
        raise RuntimeError("client went away")

    engine = _engine(model, tok)
    reqs = [engine.add_request(p, PARAMS) for p in INNOCENT]
    bad = engine.add_request([5, 6, 7], PARAMS, on_update=broken)
    while engine.has_unfinished():
        engine.step()
    assert bad.finish_reason == "abort"
    _assert_untouched(reqs, ref)
