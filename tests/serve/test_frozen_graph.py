"""Decode graphs compiled with the weights frozen into them (`serve.frozen`, `DecodeGraph(frozen=True)`,
`Engine(freeze_weights=True)`): inductor, the weights as graph constants.

Tolerances: the frozen graph multiplies through inductor's C++ GEMM template, the eager engine through MKL: other
blockings of the same fp32 sums, equal to fp32 rounding, not bitwise. The graph against itself is bitwise (the same
compiled function on the same inputs).
"""

from __future__ import annotations

import copy

import pytest
import torch
from serve_helpers import small_model

from flashnext.errors import ConfigError
from flashnext.model import fused
from flashnext.quant.apply import QuantScheme, quantize_model
from flashnext.serve import decode_graph
from flashnext.serve.cache import StateCache
from flashnext.serve.decode_graph import DecodeGraph
from flashnext.serve.engine import Engine
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.sampling import SamplingParams

TOL = dict(atol=2e-5, rtol=2e-5)
KW = dict(max_slots=2, max_model_len=48, max_num_batched_tokens=16)


@pytest.fixture
def model(small_config):
    cfg = {**small_config, "num_hidden_layers": 2, "layer_types": ["linear_attention", "indexed_attention"]}
    return small_model({**cfg, "ple_layer_ids": [1]})


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (6, 8)]


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), **TOL)


@pytest.mark.parametrize("template", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_frozen_graphs_hold_the_weights_and_retire_when_they_change(model, template, monkeypatch):
    """The frozen engine's tokens and log-probs equal the eager engine's, for a batch (the decode graph) and for one
    prompt alone (fed as compiled 2-token pieces: the prefill graph). The weights are constants of the graphs:
    after an in-place update the decode graph itself still computes the old function, bit for bit (which is why
    they retire); the engine notices the change before its next step, retires both (no recompile) and its output
    equals an eager engine's on the new weights. A weight load is refused, the weights left as they were.

    The default case compiles with `freezing` alone (aten's kernels on the frozen weights): the template's autotuning
    compiles a C++ kernel per product and choice (minutes on 2 cores); the slow case runs `FROZEN_PATCHES` itself."""
    if not template:
        monkeypatch.setattr(decode_graph, "FROZEN_PATCHES", {"freezing": True})
    prompts = _prompts(0)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0) for _ in prompts]
    engine = Engine(model, **KW, decode_graph=True, decode_buckets=[2], prefill_lengths=[2], freeze_weights=True)
    engine.chunk_graph.warmup([2])
    graph, chunks, cache = engine.decode_graph, engine.chunk_graph, engine.cache
    pieces, prefill = [], chunks.prefill
    chunks.prefill = lambda ids, slot, cached: pieces.append(len(ids)) or prefill(ids, slot, cached)
    _same(engine.generate(prompts, params), Engine(model, **KW).generate(prompts, params))
    _same(engine.generate(prompts[:1], params[:1]), Engine(model, **KW).generate(prompts[:1], params[:1]))
    assert graph.compiles == 1 and graph.bound() == [2] and graph.ready_for(2)
    assert pieces == [len(prompts[0])] and chunks.ready_for(2)

    saved = [b.clone() for b in cache.buffers()]

    def raw_step():  # the bound graph itself, from the saved state, past the engine's checks
        for b, s in zip(cache.buffers(), saved, strict=True):
            b.copy_(s)
        with torch.inference_mode():
            return graph._call(2, *graph._inputs([5, 6], [0, 1], [9, 9], 2))[0].clone()

    before = raw_step()
    with torch.no_grad():
        model.lm_head.weight.add_(0.05)
        model.model.layers[0].linear_attn.in_proj_qkv.weight.mul_(1.5)
    assert torch.equal(raw_step(), before)

    with pytest.raises(ConfigError, match="frozen"):
        engine.load_weights([("lm_head.weight", torch.zeros_like(model.lm_head.weight))])
    assert model.lm_head.weight.abs().sum() > 0
    _same(engine.generate(prompts[:1], params[:1]), Engine(model, **KW).generate(prompts[:1], params[:1]))
    _same(engine.generate(prompts, params), Engine(model, **KW).generate(prompts, params))
    assert chunks.thawed and graph.thawed and pieces == [len(prompts[0])]
    assert not graph.ready_for(2) and not chunks.ready_for(2) and graph.compiles == 1
    with pytest.raises(RuntimeError, match="retired"):
        graph.run([5, 6], [0, 1], [9, 9])


def test_frozen_graphs_refuse_what_they_cannot_hold(model, small_config):
    """Quantized weights (they would fold into float constants), a frozen engine without a decode graph; the
    refusals name what to change. Nothing is compiled."""
    quantized = quantize_model(small_model(small_config), QuantScheme("int8", "int8"))

    with pytest.raises(ConfigError, match="torch.int8.*--freeze-weights"):
        DecodeGraph(quantized, StateCache(quantized, 2, 32), buckets=[2], frozen=True)
    with pytest.raises(ConfigError, match="decode_graph=True"):
        Engine(model, **KW, freeze_weights=True)


def _bf16(model):
    return prepare_for_inference(copy.deepcopy(model).to(torch.bfloat16))


def test_batch_one_graphs_freeze_the_16bit_weights_the_cpu_multiplies(model, monkeypatch):
    """With `freeze_weights` the batch-1 decode graph holds the weights frozen for bf16 weights the CPU has
    instructions for (`fused.NATIVE_GEMM`: their products are `F.linear` on the packed bf16 weight), not for fp32
    weights nor emulated bf16 (a reduction's upcast would fold into an fp32 constant); from 2 rows always."""
    bf16 = _bf16(model)
    kw = dict(**KW, decode_graph=True, decode_buckets=[1, 2], prefill_lengths=[])
    for native in (True, False):
        monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, native)
        graph = Engine(bf16, **kw, freeze_weights=True).decode_graph
        assert (graph._freezes(1), graph._freezes(2)) == (native, True)
    graph = Engine(model, **kw, freeze_weights=True).decode_graph
    assert (graph._freezes(1), graph._freezes(2)) == (False, True)
    assert not Engine(bf16, **kw).decode_graph._freezes(2)  # nothing frozen without freeze_weights


@pytest.mark.slow
def test_frozen_bf16_batch_one_step_equals_the_plain_graph(model, monkeypatch):
    """Frozen (bf16 weights, a CPU with bf16 instructions), the batch-1 step's logits equal the plain compiled
    graph's (reductions) within bf16 rounding: every product sums in fp32 and rounds once to bf16 in both, in another
    order, so outputs differ by a bf16 step here and there (2^-8 relative), and so may the logits after two layers
    (measured: 4e-3 on logits up to ~1): 2e-2 absolute. Two compiles (~45 s on 2 cores)."""
    monkeypatch.setattr(decode_graph, "FROZEN_PATCHES", {"freezing": True})  # aten's kernels: no autotuning
    monkeypatch.setitem(fused.NATIVE_GEMM, torch.bfloat16, True)
    bf16, logits = _bf16(model), []
    for frozen in (True, False):
        engine = Engine(bf16, **KW, decode_graph=True, decode_buckets=[1], prefill_lengths=[], freeze_weights=frozen)
        graph = engine.decode_graph
        graph.warmup()
        assert graph._freezes(1) == frozen
        with torch.inference_mode():
            logits.append(graph._call(1, *graph._inputs([5], [0], [0], 1))[0].float().clone())
    assert logits[0].abs().max() > 0.5
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=2e-2)
