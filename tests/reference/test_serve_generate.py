"""The engine's greedy tokens equal the reference's `generate`, and its log-probs our full forward's.

Prompts of different lengths run together through the engine (continuous batching, chunked prefill, slots
reused), each crossing several QSA blocks and the indexer budget (budget 8 = 2 blocks of 4) over 64 new tokens.
The reference generates each prompt alone (its padded batches shift positions and conv windows), greedily, with
EOS disabled on both sides so all 64 tokens are compared.
"""

from __future__ import annotations

import pytest
import torch

import flashnext
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams

NEW_TOKENS = 64


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _reference_greedy(ref, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = ref.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny steps: thread hand-off costs more than it saves


# The decode graph: decode-only steps as the static step traced by dynamo, padded to bucket 3 ("aot_eager": the
# traced graph without code generation; the inductor twin is tests/serve/test_decode_graph.py).
DECODE_GRAPH = dict(decode_graph=True, decode_buckets=[3], compile_backend="aot_eager")


@pytest.mark.parametrize(
    ("overrides", "engine_kwargs"),
    [
        pytest.param({}, {}, id="tiny"),
        pytest.param(
            {},
            DECODE_GRAPH,
            id="tiny-decode-graph",
            # "tiny" holds the eager engine to the reference, tests/serve/test_decode_graph.py the graph to the eager
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"hc_count": 3, "num_key_value_heads": 1, "ple_layer_ids": [1, 3]},
            {},
            id="hc3-gqa4-ple2",
            marks=pytest.mark.slow,  # the same paths as "tiny" with other head/stream counts
        ),
    ],
)
def test_greedy_matches_reference_generate(overrides, engine_kwargs, tiny_text_config, reference_factory):
    cfg = tiny_text_config(**overrides)
    ref, ckpt = reference_factory(cfg, seed=3)
    model = flashnext.from_pretrained(ckpt)
    prompts = _prompts(cfg["vocab_size"], [1, 7, 13, 22], seed=5)
    # 3 slots for 4 prompts: the last one waits and reuses a freed slot; a 6-token budget chunks the prefills.
    engine = Engine(model, max_slots=3, max_model_len=128, max_num_batched_tokens=6, **engine_kwargs)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == _reference_greedy(ref, prompt), f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
        # Log-probs equal our full-sequence forward's at the same positions.
        ids = torch.tensor(prompt + out.token_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits.float(), dim=-1)
        full = lp[len(prompt) - 1 : -1].gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert (full - torch.tensor(out.logprobs)).abs().max().item() <= 1e-5
