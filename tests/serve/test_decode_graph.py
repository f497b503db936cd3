"""The compiled decode step (`serve.decode_graph`) against the eager serving step it replaces.

Default runs trace with dynamo (`fullgraph=True`: a host read inside the step would be a graph break, hence an
error) and run the captured graph with the "aot_eager" backend, which goes through functionalisation of the
in-place cache writes like inductor but generates no C++; the inductor twin (minutes of code generation on 2
cores) is marked slow and also run by `benchmarks/serve_vs_reference.py --decode-graph`.

Tolerances: the static step pads to a bucket and scores every cache block row under a mask, so its GEMMs and
reductions have other shapes than the eager step's: equal to fp32 rounding (CPU GEMM blocking follows the row
count), not bitwise.
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import run_step, small_model
from spec_helpers import compare_greedy, run_mixed, spec_model

from flashnext.errors import ConfigError
from flashnext.model import fused
from flashnext.serve.cache import StateCache
from flashnext.serve.decode_graph import DecodeGraph, bucket_sizes
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

TOL = dict(atol=2e-5, rtol=2e-5)


def _two_layers(cfg: dict) -> dict:
    """One layer of each kind (GDN with PLE, QSA): what the step holds, at half the tracing time."""
    return {
        **cfg,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "indexed_attention"],
        "ple_layer_ids": [1],
    }


@pytest.fixture
def model(small_config):
    return small_model(_two_layers(small_config))


def _prompts(n: int, seed: int, lengths=(5, 9, 3, 7)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(n)]


def _prefilled(model, prompts, slots) -> StateCache:
    cache = StateCache(model, max_slots=4, max_model_len=48)
    for slot, p in zip(slots, prompts, strict=True):
        run_step(model, cache, [(slot, 0, p)])
    return cache


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_decode_graph_equals_eager_step(model, backend):
    """Three sequences on slots 2, 0, 3 (out of order, slot 1 idle) decode 14 tokens, crossing QSA blocks and the
    indexer budget; bucket 4 pads each step by one scratch entry. Logits and the live slots' states equal the eager
    step's; the idle slot is untouched, bit for bit."""
    prompts, slots = _prompts(3, 0), [2, 0, 3]
    eager, static = _prefilled(model, prompts, slots), _prefilled(model, prompts, slots)
    graph = DecodeGraph(model, static, buckets=[4], backend=backend)
    idle = [b[1].clone() for b in static.buffers()]
    cached, tokens = [len(p) for p in prompts], [1, 2, 3]
    with torch.inference_mode():
        for _ in range(14):
            want = run_step(model, eager, [(s, c, [t]) for s, c, t in zip(slots, cached, tokens, strict=True)])
            got = graph.run(tokens, slots, cached)
            torch.testing.assert_close(got, want, **TOL)
            tokens, cached = want.argmax(-1).tolist(), [c + 1 for c in cached]
    for x, y, before in zip(eager.buffers(), static.buffers(), idle, strict=True):
        torch.testing.assert_close(y[slots], x[slots], **TOL)
        assert torch.equal(y[1], before)
    assert graph.compiles == 1


def test_engine_decode_graph_recompiles_nothing_in_steady_state(model):
    """Batches of 1..4 decodes (requests of different lengths finish at different steps, a waiting one takes a freed
    slot) after warm-up of buckets 2 and 4: no further compile, and the tokens and log-probs equal the eager
    engine's."""
    prompts = _prompts(5, 1)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in (12, 3, 9, 5, 12)]
    kwargs = dict(max_slots=4, max_model_len=48, max_num_batched_tokens=8)
    eager = Engine(model, **kwargs).generate(prompts, params)
    engine = Engine(model, **kwargs, decode_graph=True, decode_buckets=[2, 4], compile_backend="eager")
    engine.decode_graph.warmup()
    assert engine.decode_graph.compiles == 2
    frames = torch._dynamo.utils.counters["frames"]["total"]
    got = engine.generate(prompts, params)
    assert engine.decode_graph.compiles == 2
    assert torch._dynamo.utils.counters["frames"]["total"] == frames
    for g, e in zip(got, eager, strict=True):
        assert g.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), **TOL)


def test_greedy_steps_of_the_graph_carry_its_row_maxima(model):
    """Greedy requests without log-probs: every decode graph step's logits carry the graph's row maxima (which
    sampling takes for them: `tests/serve/test_sampling.py`), and the tokens equal the eager engine's."""
    prompts = _prompts(3, 8)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 7)]
    kwargs = dict(max_slots=4, max_model_len=48, max_num_batched_tokens=8)
    eager = Engine(model, **kwargs).generate(prompts, params)
    engine = Engine(model, **kwargs, decode_graph=True, decode_buckets=[4], compile_backend="eager")
    carried, run = [], engine.decode_graph.run

    def spy(ids, slots, cached):
        logits = run(ids, slots, cached)
        maxes, tokens = vars(logits)["row_maxima"]
        carried.append(torch.equal(tokens, logits.argmax(-1)) and torch.equal(maxes, logits.amax(-1)))
        return logits

    engine.decode_graph.run = spy
    got = engine.generate(prompts, params)
    assert len(carried) >= 6 and all(carried)
    assert [g.token_ids for g in got] == [e.token_ids for e in eager]


def _graph_and_eager(model, seed: int):
    """A bucket-2 graph over two prefilled slots, and `step_both()`: (compiled logits, eager logits) of one decode
    step from the same saved state (the cache restored before each)."""
    prompts, slots = _prompts(2, seed), [0, 1]
    cache = _prefilled(model, prompts, slots)
    graph = DecodeGraph(model, cache, buckets=[2], backend="aot_eager")
    cached = [len(p) for p in prompts]
    snapshot = [b.clone() for b in cache.buffers()]

    def restore():
        for b, s in zip(cache.buffers(), snapshot, strict=True):
            b.copy_(s)

    def step_both():
        restore()
        got = graph.run([5, 6], slots, cached).clone()
        restore()
        return got, run_step(model, cache, [(0, cached[0], [5]), (1, cached[1], [6])])

    return graph, step_both


def test_weight_updates_reach_the_compiled_step(model):
    """In-place updates (an optimizer-like step on a fused group's member and on the LM head) and a
    `load_state_dict` are seen by the next compiled step, without recompiling."""
    graph, step_both = _graph_and_eager(model, seed=2)
    with torch.inference_mode():
        before, _ = step_both()
        layer = model.model.layers[0]
        with torch.no_grad():
            layer.linear_attn.in_proj_qkv.weight.mul_(1.5)  # member of the fused in-projection group
            model.lm_head.weight.add_(0.1)
        got, want = step_both()
        torch.testing.assert_close(got, want, **TOL)
        assert not torch.allclose(got, before)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["model.layers.1.self_attn.q_proj.weight"].mul_(-1.0)
        model.load_state_dict(state)
        got2, want2 = step_both()
        torch.testing.assert_close(got2, want2, **TOL)
        assert not torch.allclose(got2, got)
    assert graph.compiles == 1


def test_python_values_are_baked_into_the_graph_and_not_guarded(model, monkeypatch):
    """The decode graph keeps only tensor guards (module doc): a Python value the step read while compiling stays
    as it was (here the fused products' row bound: the compiled step keeps its reductions after the bound drops to
    0, without recompiling, and still equals the eager step), while a weight replaced by one of other strides still
    recompiles the step (its tensor guard)."""
    graph, step_both = _graph_and_eager(model, seed=3)
    with torch.inference_mode():
        step_both()
        monkeypatch.setattr(fused, "REDUCED_ROWS", 0)
        got, want = step_both()
        assert graph.compiles == 1
        torch.testing.assert_close(got, want, **TOL)
        head = model.lm_head
        head.weight = torch.nn.Parameter(head.weight.detach().t().contiguous().t(), requires_grad=False)  # strides
        got, want = step_both()
        assert graph.compiles == 2
        torch.testing.assert_close(got, want, **TOL)


def test_bound_steps_skip_dynamo_and_equal_the_guarded_call(model):
    """After its compiling call, a bucket's steps run bound (module doc): dynamo's entry is not called any more
    (here it raises), and a bound step equals the same step through dynamo's entry bit for bit, logits and cache
    (the same graph function on the same tensors, by construction)."""
    graph, step_both = _graph_and_eager(model, seed=4)
    with torch.inference_mode():
        step_both()  # compiles bucket 2 through dynamo
        assert graph.bound() == []
        got, want = step_both()  # the guards passed for this layout: binds, running the step
        torch.testing.assert_close(got, want, **TOL)
        assert graph.bound() == [2]
        cache = graph.cache
        start = [b.clone() for b in cache.buffers()]
        guarded = graph._compiled[2]
        via_dynamo = guarded(*graph._inputs([7, 8], [0, 1], [9, 9], 2))[0].clone()
        after_dynamo = [b.clone() for b in cache.buffers()]
        for b, s in zip(cache.buffers(), start, strict=True):
            b.copy_(s)

        def refuse(*args):
            raise AssertionError("a bound step went through dynamo")

        graph._compiled[2] = refuse
        bound = graph.run([7, 8], [0, 1], [9, 9])
        graph._compiled[2] = guarded
    assert torch.equal(bound, via_dynamo)
    assert all(torch.equal(b, a) for b, a in zip(cache.buffers(), after_dynamo, strict=True))
    assert graph.compiles == 1


def test_a_replaced_parameter_goes_through_the_guards_then_binds_again(model):
    """A parameter's storage replaced (`p.data = ...`: same dtype, shape and strides, other values) moves the
    layout stamp: the next step runs through dynamo's entry (its guards pass: no recompile) and reads the new
    storage, equal to the eager step; the step after it is bound again, to the new storage. (A new parameter
    object also goes through dynamo's entry, which recompiles for it: see the strides test above.)"""
    graph, step_both = _graph_and_eager(model, seed=5)
    calls = []
    with torch.inference_mode():
        step_both(), step_both()
        assert graph.bound() == [2]
        guarded = graph._compiled[2]
        graph._compiled[2] = lambda *a: calls.append(1) or guarded(*a)
        before, _ = step_both()
        assert calls == []
        head = model.lm_head
        with torch.inference_mode(False):  # a plain tensor like the one it replaces (its guards pass)
            head.weight.data = head.weight.detach() * 1.5
        got, want = step_both()
        assert calls == [1]
        torch.testing.assert_close(got, want, **TOL)
        assert not torch.allclose(got, before)
        got, want = step_both()
        assert calls == [1] and graph.bound() == [2]
        torch.testing.assert_close(got, want, **TOL)
    assert graph.compiles == 1


def test_a_step_that_cannot_be_bound_keeps_going_through_dynamo(model, monkeypatch):
    """Binding reads dynamo's cache entries through private APIs: when they fail, the bucket stays on dynamo's
    path (not bound), each step runs once and equals the eager step."""
    import torch._dynamo.eval_frame as eval_frame

    def broken(code):
        raise AttributeError("no cache entries here")

    monkeypatch.setattr(eval_frame, "_debug_get_cache_entry_list", broken)
    graph, step_both = _graph_and_eager(model, seed=7)
    with torch.inference_mode():
        for _ in range(3):
            got, want = step_both()
            torch.testing.assert_close(got, want, **TOL)
    assert graph.bound() == [] and graph.compiles == 1


def test_a_parameter_object_replaced_outside_the_fused_groups_is_seen(model):
    """A norm's weight replaced by a new parameter object (other values, same layout): not a fused group's member,
    so only the layout check's re-read of the modules' slots (after any registration) can see it; the next step
    goes through dynamo (which recompiles for the new object) and equals the eager step with the new weight."""
    graph, step_both = _graph_and_eager(model, seed=6)
    with torch.inference_mode():
        step_both(), step_both()
        assert graph.bound() == [2]
        before, _ = step_both()
        norm = model.model.layers[1].self_attn.q_norm
        with torch.inference_mode(False):
            norm.weight = torch.nn.Parameter(norm.weight.detach() * -2.0, requires_grad=False)
        got, want = step_both()
        torch.testing.assert_close(got, want, **TOL)
        assert not torch.allclose(got, before)
        got, want = step_both()
        torch.testing.assert_close(got, want, **TOL)
        assert graph.bound() == [2]


def test_speculating_requests_stay_eager_and_exact(small_config):
    """A model with an MTP head, the decode graph on and speculation (k = 2) for two of three requests: steps
    holding a speculating request (drafts to verify, or the trunk residual its head needs) run eager, so
    speculation still drafts and verifies and every greedy token equals the plain eager engine's (up to near
    ties: a verify step computes 1 + k positions at once); the non-speculating request, left alone once the others
    finish, decodes through the graph (bucket 1)."""
    model = spec_model(_two_layers(small_config))
    prompts = _prompts(3, 3)
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2, num_speculative_tokens=k)
        for m, k in ((16, 0), (6, None), (5, None))
    ]  # fmt: skip
    kwargs = dict(max_slots=4, max_model_len=48, max_num_batched_tokens=32)
    plain = run_mixed(Engine(model, **kwargs), prompts, params, [0])
    engine = Engine(model, **kwargs, num_speculative_tokens=2, decode_graph=True, compile_backend="eager")
    ran = []  # the requests' slots of every graph step
    run = engine.decode_graph.run
    engine.decode_graph.run = lambda ids, slots, cached: ran.append(list(slots)) or run(ids, slots, cached)
    got = run_mixed(engine, prompts, params, [0])
    compare_greedy(plain, got)
    assert engine.stats.spec_drafted > 0 and engine.stats.spec_verify_steps > 0
    assert got[0].num_drafted == 0 and all(r.num_drafted > 0 for r in got[1:])
    assert ran and all(len(s) == 1 for s in ran)  # only the non-speculating request, alone
    assert engine.decode_graph.compiles == 1


def test_routed_experts_requests_stay_eager(model):
    """A request recording its routed experts (RL router replay) never runs through the graph (it returns logits
    only), so it still gets a row of experts per token it ran; a plain request, alone once the other finishes,
    decodes through the graph."""
    prompts = _prompts(2, 4)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, return_routed_experts=r)
              for m, r in ((5, True), (12, False))]  # fmt: skip
    engine = Engine(model, max_slots=4, max_model_len=48, max_num_batched_tokens=32, decode_graph=True,
                    compile_backend="eager")  # fmt: skip
    ran = []
    run = engine.decode_graph.run
    engine.decode_graph.run = lambda ids, slots, cached: ran.append(list(slots)) or run(ids, slots, cached)
    routed, plain = engine.generate(prompts, params)
    cfg = model.config
    assert routed.routed_experts.shape == (len(prompts[0]) + 4, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    assert plain.routed_experts is None
    assert ran and all(len(s) == 1 for s in ran)  # only the plain request, alone


def test_bucket_sizes():
    assert bucket_sizes(None, 16) == [1, 2, 4, 8, 16]
    assert bucket_sizes([4, 1], 6) == [1, 4, 6]  # max_slots closes the list
    assert bucket_sizes([8, 32], 16) == [8, 16]
    with pytest.raises(ConfigError, match="positive ints, got 0"):
        bucket_sizes([0, 4], 8)
