"""The one definition of a sampled token's log-probability under a sampling temperature.

RL needs the engine that samples and the trainer that learns to agree on what "the policy's log-prob of this
token" means: the importance ratio `exp(lp_train - lp_infer)` is 1 only if both compute the same number. Sampling
at temperature T draws from `softmax(logits / T)`, so that is the policy, and both sides compute its log-probs
with `temperature_logprobs`: the engine for the log-probs it reports (`SamplingParams.logprobs_mode =
"processed"`), the trainer's RL loss (`RLLossConfig.temperature`) for its own. Raw log-probs are T = 1.

Legend: n rows (tokens), V vocabulary.
"""

from __future__ import annotations

import torch


def temperature_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`log_softmax(logits / T)` in fp32: the log-probs of the distribution sampling at temperature T draws from.

    Args:
        logits: [n, V] (any float dtype; cast to fp32 first, so a bf16 model's logits are divided in fp32).
        temperature: a positive float, or fp32 [n, 1] per row. T = 1 divides by one, which is exact, so the
            result is bitwise the raw `log_softmax(logits.float())`.

    Returns:
        fp32 [n, V].
    """
    x = logits.float()
    if not isinstance(temperature, torch.Tensor) and temperature == 1.0:
        return torch.log_softmax(x, dim=-1)
    return torch.log_softmax(x / temperature, dim=-1)
