"""The LM head and its losses on materialised logits: the readable twins of `ops.lm_head`.

Legend: T rows (tokens), D hidden, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def linear_cross_entropy_ref(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Summed fp32 cross-entropy of the logits `hidden @ weight^T` [T, V] (computed in hidden's dtype)."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def linear_logprobs_ref(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-prob of each target and entropy of each row of the logits `hidden @ weight^T` [T, V]."""
    logp = F.log_softmax(F.linear(hidden, weight).float(), dim=-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
