"""Block-FP8 routed experts (`model.quant_experts_fp8.Fp8Experts`) inside the compiled decode step.

A model whose routed experts are FP8 (quantised from its float experts, one shared scratch, as `use_fp8_experts`
lays them out) serves through the decode graph as through the eager engine. The eager step dequantises the touched
experts and runs the grouped path; the static step dequantises each assignment's expert and runs the gather path
(`Fp8Experts._per_assignment`): the same dequantised weights through GEMMs of other shapes, so log-probs agree to
fp32 rounding (1e-4 absolute over 12 steps), not bitwise, and the greedy tokens are equal.
"""

from __future__ import annotations

import pytest
import torch

from flashnext.config import parse_config
from flashnext.model.moe import Experts
from flashnext.model.quant_experts_fp8 import ExpertScratch, Fp8Experts
from flashnext.model.text import FlashNextForCausalLM
from flashnext.serve.engine import Engine
from flashnext.serve.prepare import prepare_for_inference
from flashnext.serve.sampling import SamplingParams

OVERRIDES = dict(vocab_size=256, num_hidden_layers=2, ple_layer_ids=[1],
                 layer_types=["linear_attention", "indexed_attention"])  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def _fp8_model(small_config) -> FlashNextForCausalLM:
    model = FlashNextForCausalLM(parse_config({**small_config, **OVERRIDES}).text).eval()
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    scratch, swapped = ExpertScratch(), 0
    for name, old in list(model.named_modules()):
        if type(old) is Experts:
            E, two_i, D = old.gate_up_proj.shape
            new = Fp8Experts(E, D, two_i // 2, dtype=torch.float32, scratch=scratch)
            new.requantize_("gate_up_proj", 0, old.gate_up_proj.detach())
            new.requantize_("down_proj", 0, old.down_proj.detach())
            model.set_submodule(name, new)
            swapped += 1
    assert swapped >= 2
    return prepare_for_inference(model)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fp8_experts_decode_graph_equals_eager(small_config, backend):
    model = _fp8_model(small_config)
    prompts = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    kwargs = dict(max_slots=4, max_model_len=64, max_num_batched_tokens=64)
    eager = Engine(model, **kwargs).generate(prompts, params)
    engine = Engine(model, **kwargs, decode_graph=True, decode_buckets=[2], compile_backend=backend)
    graph = engine.generate(prompts, params)
    assert engine.decode_graph.compiles == 1
    for g, e in zip(graph, eager, strict=True):
        assert g.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
