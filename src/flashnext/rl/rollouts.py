"""Rollouts: group advantages, zero-advantage filtering, and packing samples into the trainer's micro-batches.

A step samples `group_size` completions of each of `batch_size` prompts. Each completion's advantage is its reward
minus its group's mean (optionally divided by the group's standard deviation); a group whose rewards are all equal
teaches nothing (every advantage is 0) and is dropped by default.

A sample becomes one packed sequence `prompt + completion` (legend: P prompt tokens, C completion tokens, L decoder
layers, k experts per token):
- `labels`: -100 on the prompt, the completion's ids on the completion, so only completion tokens carry loss;
- `inference_logprobs [P + C]`: 0 on the prompt, then the engine's log-prob of each completion token (temperature
  processed, `flashnext.logprobs`), entry t belonging to token t as the trainer's RL records expect;
- `advantages [P + C]`: 0 on the prompt, the sample's advantage on every completion token;
- `routed_experts [P + C, L, k]`: the experts the engine ran each token through (the last completion token was
  never run: it ended the request; its row is `0..k-1`, which no loss depends on: a causal model's last position
  predicts nothing inside the sequence);
- images: the prompt's pixels, `mm_token_type_ids` 1 on the prompt's placeholders only (a placeholder id the model
  generated is a text token, as the engine ran it) and the `[3, P + C]` MRoPE positions.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flashnext.batch import PackedBatch
from flashnext.errors import InputError


@dataclass
class Sample:
    """One completion of one prompt, as sampled and scored.

    Attributes:
        task: the environment's task data; group: the prompt's index in its step's batch.
        prompt_ids / completion_ids: token ids; logprobs: the engine's log-prob of each completion token.
        routed: uint16 [P + C - 1, L, k] experts of the tokens the engine ran, or None (no router replay).
        reward, metrics: the environment's score; policy_step: the weights (trainer step) that sampled it.
        finish_reason: the engine's ("stop", "length"); advantage: set by `assign_advantages`.
        pixel_values / image_grid_thw: the prompt's images (None for text).
    """

    task: dict[str, Any]
    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_step: int
    finish_reason: str = "stop"
    metrics: dict[str, float] = field(default_factory=dict)
    routed: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    advantage: float = 0.0
    loss_mask: list[int] | None = None
    """Multi-turn episodes: 1 on the ids the engine sampled, 0 on the environment's ids between turns (in the
    sequence, out of the loss); None: every completion id is sampled."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def group_advantages(rewards: torch.Tensor, std_normalize: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """A = r - mean(group), optionally / (std(group) + eps) (population std).

    Args:
        rewards: [B, G] float, one row per prompt (group).

    Returns:
        float64 [B, G].
    """
    r = rewards.double()
    adv = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        adv = adv / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv


def assign_advantages(
    groups: list[list[Sample]], std_normalize: bool = False, drop_zero: bool = True
) -> tuple[list[Sample], int]:
    """Set each sample's advantage from its group; returns (kept samples in order, groups dropped).

    A group whose rewards are all equal has advantage 0 everywhere (nothing to learn); with `drop_zero` it is left
    out. Groups may differ in size (a failed completion is already missing); each is normalised on its own.

    Raises:
        InputError: a reward is not finite (a NaN would otherwise make its group look all-equal and vanish, or
            poison the loss); the orchestrator leaves NaN-scored samples out, and counts them, before this.
    """
    kept, dropped = [], 0
    for group in groups:
        rewards = [s.reward for s in group]
        if bad := [r for r in rewards if not math.isfinite(r)]:
            raise InputError(f"group {group[0].group}: non-finite reward(s) {bad} (rewards {rewards})")
        if drop_zero and (not group or max(rewards) == min(rewards)):
            dropped += 1
            continue
        adv = group_advantages(torch.tensor([rewards]), std_normalize)[0].tolist()
        for s, a in zip(group, adv, strict=True):
            s.advantage = a
        kept.extend(group)
    return kept, dropped


def sample_batch(s: Sample, num_layers: int | None = None, top_k: int | None = None, mrope=None) -> PackedBatch:
    """One sample as a one-sequence `PackedBatch` (see the module doc).

    Args:
        num_layers, top_k: the replay's shape (needed to pad the last token's row); ignored without `s.routed`.
        mrope: `(spatial_merge_size, image_token_id)` of a composite model, for a sample with images.
    """
    P, C = len(s.prompt_ids), len(s.completion_ids)
    if C == 0 or len(s.logprobs) != C:
        raise InputError(f"sample of group {s.group}: {C} completion tokens but {len(s.logprobs)} log-probs")
    mask = s.loss_mask if s.loss_mask is not None else [1] * C
    if len(mask) != C:
        raise InputError(f"sample of group {s.group}: {C} completion tokens but a loss mask of {len(mask)}")
    labels = [t if m else -100 for t, m in zip(s.completion_ids, mask, strict=True)]
    b = PackedBatch.from_sequences([s.prompt_ids + s.completion_ids], [[-100] * P + labels])
    b.inference_logprobs = torch.tensor([0.0] * P + [lp if m else 0.0 for lp, m in zip(s.logprobs, mask, strict=True)],
                                        dtype=torch.float32)  # fmt: skip
    b.advantages = torch.tensor([0.0] * P + [float(s.advantage) if m else 0.0 for m in mask], dtype=torch.float32)
    if s.routed is not None:
        rows = s.routed.long()
        missing = P + C - rows.shape[0]
        if missing < 0 or rows.shape[1:] != (num_layers, top_k):
            raise InputError(
                f"sample of group {s.group}: routed experts {tuple(rows.shape)} for {P + C} tokens, expected "
                f"[<= {P + C}, {num_layers}, {top_k}]"
            )
        pad = torch.arange(top_k, dtype=torch.long).expand(missing, num_layers, top_k)
        b.routed_experts = torch.cat([rows, pad])
    if s.pixel_values is not None:
        from flashnext.model.multimodal import get_rope_index

        merge, image_token_id = mrope
        types = torch.zeros(P + C, dtype=torch.long)
        types[:P] = (torch.tensor(s.prompt_ids) == image_token_id).long()
        positions, _ = get_rope_index(b.input_ids, [0, P + C], types, s.image_grid_thw, merge)
        b.position_ids, b.mm_token_type_ids = positions, types
        b.pixel_values, b.image_grid_thw = s.pixel_values, s.image_grid_thw.long()
    return b


def pack_samples(
    samples: list[Sample],
    token_budget: int,
    num_layers: int | None = None,
    top_k: int | None = None,
    mrope=None,
) -> list[PackedBatch]:
    """Micro-batches of at most `token_budget` tokens (a longer sample alone), samples in order; text and image
    samples never share one (their position layouts differ)."""
    out: list[PackedBatch] = []
    parts: list[PackedBatch] = []
    used, images = 0, None
    for s in samples:
        b = sample_batch(s, num_layers, top_k, mrope)
        has_images = b.pixel_values is not None
        if parts and (used + b.num_tokens > token_budget or has_images != images):
            out.append(PackedBatch.concat(parts))
            parts, used = [], 0
        parts.append(b)
        used += b.num_tokens
        images = has_images
    if parts:
        out.append(PackedBatch.concat(parts))
    return out


def empty_like(b: PackedBatch) -> PackedBatch:
    """`b` with no loss token (labels -100, advantages 0): a stand-in micro-batch that keeps ranks in step."""
    return dataclasses.replace(b, labels=torch.full_like(b.labels, -100), advantages=torch.zeros_like(b.advantages))
