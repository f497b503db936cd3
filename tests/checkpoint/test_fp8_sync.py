"""A weight update from a trainer (bf16/fp32 weights) into a model with FP8 experts: requantised on arrival, all or
nothing (`serve/weight_update.py` `Targets.requantize`, `Fp8Experts.requantize_`)."""

from __future__ import annotations

import pytest
import torch
from test_fp8_checkpoint import checkpoints  # noqa: F401  (the module fixture)

import flashnext
from flashnext.errors import InputError
from flashnext.ops.fp8_blocks import quantize_blocks
from flashnext.serve.weight_update import StagedUpdate, WeightPiece, copy_pieces, encode_piece

GATE_UP = "model.layers.2.mlp.experts.gate_up_proj"


def _trainer(path):
    trainer = flashnext.from_pretrained(path)  # the bf16 source: plain experts, fp32 here
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    return trainer


def _expected(experts, e):
    """The test's own per-tensor quantisation of one trainer expert: (gate q, up q, down q) and scales."""
    gu, down = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()
    return [quantize_blocks(t) for t in (gu[:128], gu[128:], down)]


def test_a_sync_requantises_the_experts_on_arrival(checkpoints):  # noqa: F811
    engine_model = flashnext.from_pretrained(checkpoints[1])
    trainer = _trainer(checkpoints[0])
    # A trainer with frozen n-gram tables (`model.freeze_ngram`) sends everything but the tables.
    pieces = [(n, p.detach()) for n, p in trainer.named_parameters() if ".ngram_embedding." not in n]
    count, _ = copy_pieces(engine_model, pieces)
    assert count == len(pieces)
    for i, layer in enumerate(engine_model.model.layers):
        fp8, src = layer.mlp.experts, trainer.model.layers[i].mlp.experts
        assert fp8.gate_up_proj.dtype == torch.float8_e4m3fn
        for e in (0, 3):
            (gq, gs), (uq, us), (dq, ds) = _expected(src, e)
            assert torch.equal(fp8.gate_up_proj[e, :128].float(), gq.float())
            assert torch.equal(fp8.gate_up_proj[e, 128:].float(), uq.float())
            assert torch.equal(fp8.down_proj[e].float(), dq.float())
            assert torch.equal(fp8.gate_up_proj_scale_inv[e], torch.cat([gs, us]))
            assert torch.equal(fp8.down_proj_scale_inv[e], ds)
    assert torch.equal(engine_model.model.embed_tokens.weight, trainer.model.embed_tokens.weight)


def test_a_bad_piece_leaves_the_fp8_experts_untouched(checkpoints):  # noqa: F811
    engine_model = flashnext.from_pretrained(checkpoints[1])
    before = {k: v.clone() for k, v in engine_model.state_dict().items()}
    trainer = _trainer(checkpoints[0])
    good = WeightPiece(GATE_UP, trainer.get_parameter(GATE_UP).detach()[:2], 0)  # experts 0-1, fp32
    bad = WeightPiece("model.layers.0.mlp.gate.weight", torch.zeros(3, 3))
    with pytest.raises(InputError, match="model.layers.0.mlp.gate.weight"):
        copy_pieces(engine_model, [good, bad])
    with pytest.raises(InputError, match="int32"):  # only float pieces are requantised
        copy_pieces(engine_model, [WeightPiece(GATE_UP, torch.zeros(1, 256, 256, dtype=torch.int32))])
    # Over HTTP: staged, then applied at the end of the update, the same requantisation.
    staged = StagedUpdate(engine_model)
    reader = staged.reader()
    head, payload = encode_piece(good)
    for piece in reader.feed(head + bytes(payload)):
        staged.keep(piece)
    after = engine_model.state_dict()
    floats = [k for k in before if before[k].is_floating_point()]
    assert all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in floats)
    staged.apply()
    (gq, gs), _, _ = _expected(trainer.get_submodule(GATE_UP.rsplit(".", 1)[0]), 1)
    experts = engine_model.get_submodule(GATE_UP.rsplit(".", 1)[0])
    assert torch.equal(experts.gate_up_proj[1, :128].float(), gq.float())
    assert torch.equal(experts.gate_up_proj_scale_inv[1, :1], gs)
    assert torch.equal(experts.gate_up_proj[2], before[GATE_UP][2])  # experts outside the piece unchanged


def test_the_engine_serves_fp8_experts_as_the_dequantised_twin(checkpoints):  # noqa: F811
    """Serving (prefill chunks, decode steps, fused GEMMs) with FP8 experts gives the twin's greedy tokens and
    log-probs (the twin: every expert dequantised into plain `Experts`; fp32 rounding of other GEMM shapes)."""
    from flashnext.model.quant_experts_fp8 import reference_experts
    from flashnext.serve.engine import Engine
    from flashnext.serve.sampling import SamplingParams

    fp8 = flashnext.from_pretrained(checkpoints[1])
    twin = flashnext.from_pretrained(checkpoints[1])
    for layer in twin.model.layers:
        layer.mlp.experts = reference_experts(layer.mlp.experts)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    got, want = (Engine(m, None, 4, 64, 8).generate(prompts, params) for m in (fp8, twin))
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) <= 1e-4
