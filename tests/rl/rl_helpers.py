"""Small models and the trainer's per-token view of a packed rollout batch, shared by the RL tests."""

from __future__ import annotations

import torch

from flashnext.batch import make_segments, next_token_targets
from flashnext.build import build_model
from flashnext.config import parse_config, tiny_config
from flashnext.train.loss import token_logprobs

VS, VE, IMG = 512, 513, 514  # vision ids outside the bundled tokenizer's 512, so text never encodes to them
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
)  # fmt: skip


def perturb(model: torch.nn.Module, scale: float = 0.1, seed: int = 1) -> torch.nn.Module:
    """Every parameter moved off its init (norms, convs and the router matter), deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def text_model(seed: int = 0) -> torch.nn.Module:
    """The tiny default config (bundled tokenizer's vocab), randomly initialised and perturbed."""
    return perturb(build_model(tiny_config(), seed=seed))


def composite_config():
    text = tiny_config().to_dict()
    text["vocab_size"] = 516
    return parse_config(dict(model_type="qwen4_exp", text_config=text, vision_config=dict(VISION),
                             image_token_id=IMG, vision_start_token_id=VS, vision_end_token_id=VE))  # fmt: skip


def composite_model(seed: int = 0) -> torch.nn.Module:
    return perturb(build_model(composite_config(), seed=seed))


def trainer_view(model, b, temperature: float = 1.0):
    """(trainer log-probs, engine log-probs, loss mask) per token of packed batch `b`, computed as the trainer's
    RL step computes them (forward with the batch's routed experts replayed, targets shifted to the predicting
    token, `token_logprobs` at the temperature)."""
    out = model(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids, routed_experts=b.routed_experts,
                **b.image_kwargs())  # fmt: skip
    seg = make_segments(b.cu_seqlens, b.num_tokens, b.position_ids)
    targets = next_token_targets(b.labels, seg)
    mask = targets != -100
    lp_train, _ = token_logprobs(out.logits, torch.where(mask, targets, 0), temperature)
    return lp_train, next_token_targets(b.inference_logprobs, seg, 0.0), mask
