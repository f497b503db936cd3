"""The compiled prefill chunks (`serve.chunk_graph.ChunkGraph`) and the static chunk step they run
(`model.state.make_chunk_step`), against the eager serving step.

The static step is checked uncompiled (its semantics: block planning of a chunk crossing QSA blocks, the n-gram
and conv histories, the last-token row) and through dynamo with the "aot_eager" backend (`fullgraph=True`: a host
read inside the step is an error); the inductor twin is marked slow.

Tolerances: the static step runs other kernels than the eager step (the GDN chunk fitted to each piece, the
experts of every token through `_dense`'s or `_reduced`'s shapes, every cache block row scored under a mask), so
logits and states equal to fp32 rounding, not bitwise; slots the step does not own are compared bitwise.
"""

from __future__ import annotations

import pytest
import torch
from serve_helpers import run_step, small_model

from flashnext.batch import history_layout, make_segments
from flashnext.errors import ConfigError
from flashnext.model.state import make_chunk_step
from flashnext.serve.cache import StateCache
from flashnext.serve.chunk_graph import ChunkGraph
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

TOL = dict(atol=3e-5, rtol=3e-5)


@pytest.fixture
def model(small_config):
    return small_model(
        {
            **small_config,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "indexed_attention"],
            "ple_layer_ids": [1],
        }  # fmt: skip
    )


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _static_step(model, cache, slot: int, cached: int, ids: list[int]) -> torch.Tensor:
    step = make_chunk_step(torch.tensor([slot]), torch.tensor([cached]), len(ids), cache.scratch_slot)
    return model.forward_step(torch.tensor(ids), step, cache)


@pytest.mark.parametrize("pieces", [[7], [3, 6, 1], [2, 9, 5], [4, 4, 8]])
def test_static_chunk_step_equals_eager_step(model, pieces):
    """A prompt fed in chunks of `pieces` tokens (cache ratio 4: chunks starting mid-block, completing zero, one
    and two blocks, and a chunk before any block is complete) on slot 1 of 3: after every chunk the last-token
    logits and the slot's state equal the eager step's; slots 0 and 2 are untouched, bit for bit."""
    eager, static = (StateCache(model, max_slots=3, max_model_len=48) for _ in range(2))
    before = [b.clone() for b in static.buffers()]
    ids, cached = _ids(sum(pieces), 0), 0
    with torch.inference_mode():
        for n in pieces:
            chunk = ids[cached : cached + n]
            want = run_step(model, eager, [(1, cached, chunk)])
            got = _static_step(model, static, 1, cached, chunk)
            torch.testing.assert_close(got, want, **TOL)
            cached += n
    for x, y, b in zip(eager.buffers(), static.buffers(), before, strict=True):
        torch.testing.assert_close(y[1], x[1], **TOL)
        assert torch.equal(y[0], b[0]) and torch.equal(y[2], b[2])


@pytest.mark.parametrize(("N", "L", "W"), [(1, 5, 2), (3, 1, 2), (2, 4, 3), (2, 0, 1)])
def test_equal_length_history_layout_is_the_per_sequence_one(N, L, W):
    """`history_layout`'s device math for N sequences of L tokens each against the layout written per sequence:
    sequence i's extended rows start at i * (W + L), its W history rows first."""
    seg = make_segments(torch.arange(N + 1, dtype=torch.int32) * L, N * L, torch.zeros(N * L, dtype=torch.long))
    got = history_layout(seg, W)
    starts = [i * (W + L) for i in range(N)]
    assert got.pos.tolist() == [j for _ in range(N) for j in range(W + L)]
    assert got.real.tolist() == [s + W + j for s in starts for j in range(L)]
    assert got.head.tolist() == [[s + j for j in range(W)] for s in starts]
    assert got.tail.tolist() == [[s + L + j for j in range(W)] for s in starts]


def _warm(model, cache, lengths, backend="aot_eager") -> ChunkGraph:
    graph = ChunkGraph(model, cache, lengths=lengths, backend=backend)
    graph.warmup()
    return graph


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_chunk_graph_prefill_equals_eager_prefill(model, backend):
    """A 15-token prompt and a 6-token continuation on slot 0 of 2, as pieces 8 + 4 + 2 + 1 and 4 + 2 of the
    compiled lengths: last-token logits and the slot's state equal one eager chunk each; slot 1 is untouched.
    Warming up touches only the scratch slot."""
    eager, cache = (StateCache(model, max_slots=2, max_model_len=48) for _ in range(2))
    before = [b.clone() for b in cache.buffers()]
    graph = _warm(model, cache, [1, 2, 4, 8], backend)
    assert sorted(graph.ready) == [1, 2, 4, 8] and graph.compiles == 4
    for x, b in zip(cache.buffers(), before, strict=True):
        assert torch.equal(x[:2], b[:2])
    assert graph.pieces(15) == [8, 4, 2, 1] and graph.pieces(6) == [4, 2]
    ids = _ids(21, 1)
    with torch.inference_mode():
        for start, stop in ((0, 15), (15, 21)):
            want = run_step(model, eager, [(0, start, ids[start:stop])])
            got = graph.prefill(ids[start:stop], 0, start)
            torch.testing.assert_close(got, want, **TOL)
    for x, y, b in zip(eager.buffers(), cache.buffers(), before, strict=True):
        torch.testing.assert_close(y[0], x[0], **TOL)
        assert torch.equal(y[1], b[1])
    assert graph.compiles == 4  # the pieces reused the warmed graphs


def test_pieces_use_ready_lengths_only(model):
    """Nothing ready: no pieces (the step runs eager). Lengths never compile on a step; a remainder the ready
    lengths cannot make up is no pieces either."""
    graph = ChunkGraph(model, StateCache(model, max_slots=1, max_model_len=32), lengths=[1, 4, 16])
    assert graph.pieces(5) is None and not graph.ready_for(5)
    graph.ready.update({4, 16})
    assert graph.pieces(36) == [16, 16, 4] and graph.pieces(6) is None
    with pytest.raises(ConfigError, match="positive ints"):
        ChunkGraph(model, StateCache(model, max_slots=1, max_model_len=32), lengths=[0, 4])


def test_engine_prefills_through_the_chunk_graph(model):
    """An engine with its prefill lengths warmed: plain prompts of 1..13 tokens (one prompt split over two steps by
    the token budget) prefill as compiled pieces, and the tokens and log-probs equal the eager engine's; a request
    asking for prompt log-probs stays on the eager path."""
    prompts = [_ids(n, n) for n in (13, 5, 1, 9)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    kwargs = dict(max_slots=1, max_model_len=48, max_num_batched_tokens=10)
    want = Engine(model, **kwargs).generate(prompts, params)
    engine = Engine(model, **kwargs, decode_graph=True, decode_buckets=[1], compile_backend="aot_eager")
    engine.chunk_graph.warmup([1, 2, 4, 8])
    calls = []
    prefill = engine.chunk_graph.prefill
    engine.chunk_graph.prefill = lambda ids, slot, cached: calls.append(len(ids)) or prefill(ids, slot, cached)
    got = engine.generate(prompts, params)
    assert calls == [10, 3, 5, 1, 9]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), **TOL)
    calls.clear()
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert calls == []
