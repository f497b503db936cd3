"""Sampler and learner agree (fp32, synchronous, router replay): the trainer's recomputed log-probs equal the
engine's and the mismatch KL is ~0, on text and on an image prompt (vision tower through the engine); the engine's
recorded experts are the training forward's own routing; temperature-processed log-probs are the trainer's."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import composite_model, text_model, trainer_view

from flashnext.logprobs import temperature_logprobs
from flashnext.rl.envs import ColorEnv, ReverseEnv
from flashnext.rl.inference import LocalInference, SamplingSpec
from flashnext.rl.orchestrator import Orchestrator
from flashnext.rl.rollouts import pack_samples
from flashnext.serve.engine import Engine
from flashnext.serve.sampling import SamplingParams, sample
from flashnext.tokenizer import load_tokenizer
from flashnext.train.loss import rl_loss

# Engine (fused serving GEMMs, cached state, decode one token at a time) and trainer (plain path, whole sequence)
# run different kernels on different shapes, so their fp32 log-probs agree to rounding (observed ~1e-6), not bitwise.
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def tok():
    torch.set_num_threads(2)
    return load_tokenizer()


def _rollouts(model, env, tok, temperature, groups=3, group_size=4, max_tokens=10):
    """One synchronous step's samples: the engine runs a copy of `model`'s weights (a second instance)."""
    engine_model = type(model)(getattr(model, "model_config", None) or model.config)
    engine_model.load_state_dict(model.state_dict())
    engine_model.reset_buffers()
    env.setup(tok, getattr(model, "model_config", None) or model.config)
    spec = SamplingSpec(max_tokens, temperature, [tok.eos_token_id], routed_experts=True)
    orch = Orchestrator(env, LocalInference(Engine(engine_model, tok, 16, 256, 128)), spec, groups, group_size,
                        seed=7, drop_zero=False)  # fmt: skip
    return orch.rollouts(step=1, policy_step=0).samples


def _check_agreement(model, samples, temperature, mrope=None):
    cfg = model.config
    batches = pack_samples(samples, 4096, cfg.num_hidden_layers, cfg.num_experts_per_tok, mrope)
    for b in batches:
        lp_train, lp_infer, mask = trainer_view(model, b, temperature)
        assert mask.sum() == sum(len(s.completion_ids) for s in samples if True) or len(batches) > 1
        diff = (lp_train - lp_infer)[mask].abs().max().item()
        assert diff <= LOGPROB_TOL, diff
        _, metrics = rl_loss(lp_train, lp_infer, torch.zeros_like(lp_train), mask, int(mask.sum()))
        assert metrics["mismatch_kl"] <= 1e-6 and metrics["masked_fraction"] == 0
        assert metrics["mismatch_kl_unmasked"] <= 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_text_trainer_logprobs_equal_the_engines(tok, temperature):
    model = text_model().train()
    samples = _rollouts(model, ReverseEnv(), tok, temperature)
    assert len(samples) == 12 and all(s.routed is not None for s in samples)
    _check_agreement(model, samples, temperature)


def test_image_prompt_trainer_logprobs_equal_the_engines(tok):
    pytest.importorskip("PIL")
    pytest.importorskip("transformers")
    model = composite_model().train()
    model.freeze_vision()
    samples = _rollouts(model, ColorEnv(size=16), tok, 1.0, groups=2, group_size=3, max_tokens=6)
    assert all(s.pixel_values is not None and 514 in s.prompt_ids for s in samples)
    vision = model.model_config.vision_config
    _check_agreement(model, samples, 1.0, mrope=(vision.spatial_merge_size, model.image_token_id))


def test_recorded_experts_are_the_training_forwards_own_routing(tok):
    """Without replay, the training forward routes every token (but the last of each sequence, never run by the
    engine) to exactly the experts the engine recorded."""
    model = text_model().train()
    samples = _rollouts(model, ReverseEnv(), tok, 1.0)
    cfg = model.config
    (b,) = pack_samples(samples, 4096, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    with torch.no_grad():
        own = model(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids).routed_experts
    run = torch.ones(b.num_tokens, dtype=torch.bool)
    run[(b.cu_seqlens[1:] - 1).long()] = False
    assert torch.equal(own[run], b.routed_experts[run])
    assert samples[0].routed.dtype == torch.uint16


def test_processed_logprobs_are_the_temperature_scaled_distribution():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.5, logprobs_mode="processed", seed=1),
              SamplingParams(temperature=0.5, seed=1),  # raw
              SamplingParams(temperature=2.0, logprobs_mode="processed", seed=2),
              SamplingParams(temperature=0.0, logprobs_mode="processed")]  # greedy: no distribution, raw  # fmt: skip
    _, lp = sample(logits, params, [torch.Generator().manual_seed(p.seed or 0) for p in params])
    assert torch.equal(lp[0], temperature_logprobs(logits[:1], 0.5)[0])
    assert torch.equal(lp[1], torch.log_softmax(logits[1], -1))
    assert torch.equal(lp[2], temperature_logprobs(logits[2:3], 2.0)[0])
    assert torch.equal(lp[3], torch.log_softmax(logits[3], -1))
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="scaled").validate()
