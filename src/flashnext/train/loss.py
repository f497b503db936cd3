"""Training losses on flat token streams: SFT cross-entropy, the MTP head's, and the RL (IPO) policy loss.

Legend: T = tokens in the flat (micro-batch) stream, V = vocabulary.

Every loss divides a *sum* over this micro-batch's loss tokens by a count taken over the whole optimizer step
(every micro-batch, every rank), so summing the micro-batch losses (and their gradients) gives the step's mean
whatever way the tokens were split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from flashnext.batch import Segments, make_segments, next_token_targets
from flashnext.errors import InputError
from flashnext.logprobs import temperature_logprobs
from flashnext.model.mtp import mtp_targets

IGNORE_INDEX = -100


def _as_segments(seg_or_cu: Segments | torch.Tensor, num_tokens: int, device: torch.device) -> Segments:
    if isinstance(seg_or_cu, Segments):
        if seg_or_cu.num_tokens != num_tokens:
            raise InputError(f"segments cover {seg_or_cu.num_tokens} tokens, the stream has T={num_tokens}")
        return seg_or_cu
    return make_segments(seg_or_cu, num_tokens, device=device)


def step_mean(total: torch.Tensor, count: int | torch.Tensor, name: str = "num_label_tokens") -> torch.Tensor:
    """A micro-batch's loss sum divided by the optimizer step's loss-token count (0 when the count is 0).

    What `sft_loss` returns, from a sum computed elsewhere (e.g. the model's chunked `out.loss_sum`).
    """
    return _divide(total, count, name)


def _divide(total: torch.Tensor, count: int | torch.Tensor, name: str) -> torch.Tensor:
    # A step without loss tokens has a zero sum; dividing by at least 1 keeps it 0 rather than NaN.
    if isinstance(count, torch.Tensor):
        return total / count.to(device=total.device, dtype=torch.float32).clamp_min(1)
    if count < 0:
        raise InputError(f"{name} must be >= 0, got {count}")
    return total / max(int(count), 1)


def _targets(labels: torch.Tensor, seg_or_cu: Segments | torch.Tensor, shifted) -> torch.Tensor:
    """`shifted(labels, seg, IGNORE_INDEX)` (`next_token_targets` or `mtp_targets`) within each packed sequence."""
    return shifted(labels, _as_segments(seg_or_cu, labels.shape[0], labels.device), IGNORE_INDEX)


def _check_rows(logits: torch.Tensor, labels: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise InputError(f"{name} must be [T, V] and labels [T], got {tuple(logits.shape)} and {tuple(labels.shape)}")


def _summed_ce(logits: torch.Tensor, targets: torch.Tensor, count: int | torch.Tensor, name: str) -> torch.Tensor:
    """Cross-entropy summed in fp32 over the targets that are not -100, divided by the step's `count`."""
    total = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return _divide(total, count, name)


def count_label_tokens(labels: torch.Tensor, seg_or_cu: Segments | torch.Tensor) -> int:
    """Number of tokens `sft_loss` sums over in one micro-batch (sum it over the step for `num_label_tokens`)."""
    return int((_targets(labels, seg_or_cu, next_token_targets) != IGNORE_INDEX).sum())


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    seg_or_cu: Segments | torch.Tensor,
    num_label_tokens: int | torch.Tensor,
) -> torch.Tensor:
    """Next-token cross-entropy within each packed sequence, summed in fp32 and divided by the step's count.

    Token t's target is `labels[t + 1]` when t + 1 is in the same sequence; each sequence's last token and
    targets equal to -100 carry no loss.

    Args:
        logits: [T, V] (any float dtype; the loss is computed in fp32).
        labels: int64 [T], -100 where there is no loss.
        seg_or_cu: the stream's `Segments`, or `cu_seqlens` int [N+1].
        num_label_tokens: loss tokens across the whole optimizer step (all micro-batches and ranks), e.g. the sum
            of `count_label_tokens` over them.

    Returns:
        0-d fp32 tensor; summing it over the step's micro-batches gives the mean over the step's loss tokens.
    """
    _check_rows(logits, labels, "logits")
    return shifted_sft_loss(logits, _targets(labels, seg_or_cu, next_token_targets), num_label_tokens)


def shifted_sft_loss(logits: torch.Tensor, targets: torch.Tensor, num_label_tokens: int | torch.Tensor) -> torch.Tensor:
    """`sft_loss` of targets already shifted (`targets[t]` is what row t predicts, -100 none), e.g. a
    context-parallel rank's slice of targets formed on the whole stream. logits [T, V], targets int64 [T]."""
    return _summed_ce(logits, targets, num_label_tokens, "num_label_tokens")


def count_mtp_tokens(labels: torch.Tensor, seg_or_cu: Segments | torch.Tensor) -> int:
    """Number of tokens `mtp_loss` sums over in one micro-batch (targets `labels[t + 2]` within a sequence)."""
    return int((_targets(labels, seg_or_cu, mtp_targets) != IGNORE_INDEX).sum())


def mtp_loss(
    mtp_logits: torch.Tensor,
    labels: torch.Tensor,
    seg_or_cu: Segments | torch.Tensor,
    num_mtp_tokens: int | torch.Tensor,
) -> torch.Tensor:
    """The MTP head's next-next-token cross-entropy, summed in fp32 and divided by the step's count.

    Position t's draft logits (`CausalLMOutput.mtp_logits`, from the trunk's state at t and token t + 1) target
    `labels[t + 2]` when t + 2 is in the same sequence; the last two tokens of each sequence and -100 targets
    carry no loss.

    Args:
        mtp_logits: [T, V]. labels: int64 [T]. seg_or_cu: `Segments` or `cu_seqlens` int [N+1].
        num_mtp_tokens: the step's count (sum of `count_mtp_tokens` over its micro-batches and ranks).

    Returns:
        0-d fp32 tensor; summed over the step's micro-batches, the mean over the step's MTP target tokens.
    """
    _check_rows(mtp_logits, labels, "mtp_logits")
    return _summed_ce(mtp_logits, _targets(labels, seg_or_cu, mtp_targets), num_mtp_tokens, "num_mtp_tokens")


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each row, in fp32, under a sampling temperature.

    Args:
        logits: [T, V]; row t is the distribution that produced `targets[t]` (already shifted by the caller).
        targets: int64 [T], valid vocabulary ids.
        temperature: the distribution is `softmax(logits / temperature)`
            (`flashnext.logprobs.temperature_logprobs`, the definition the engine's processed log-probs share).

    Returns:
        logprobs [T] (differentiable) and entropy [T] (differentiable), both fp32.
    """
    logp_TV = temperature_logprobs(logits, temperature)
    logprobs = logp_TV.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_TV.exp() * logp_TV).sum(-1)
    return logprobs, entropy


class RLLossConfig(BaseModel):
    """The RL policy loss (prime-rl's IPO default)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    eps: float = Field(0.1, ge=0.0)
    """A loss token is masked (no loss, no gradient) when |p_train - p_infer| > eps, p = exp(logprob)."""
    adv_tau: float = Field(1.0, ge=0.0)
    """Weight of the advantage term -A * r of the per-token loss."""
    kl_tau: float = Field(1e-3, ge=0.0)
    """Weight of the (log r)^2 penalty that keeps the trainer near the inference policy (0 turns it off)."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature of the rollouts: the trainer's log-probs are those of `softmax(logits / temperature)`,
    as the engine's processed log-probs (`flashnext rl` also samples with it; RL records must have been sampled
    at it)."""


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, 0.0).sum() / mask.sum().clamp_min(1)


def rl_loss(
    logprobs_train: torch.Tensor,
    logprobs_infer: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    num_loss_tokens: int | torch.Tensor,
    config: RLLossConfig | None = None,
    entropy: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance-weighted policy loss with probability-difference masking and a (log r)^2 penalty.

    With `r = exp(lp_train - lp_infer)`, each loss token whose probabilities agree within `eps` contributes
    `-adv_tau * A * r + kl_tau * (log r)^2`; the sum is divided by `num_loss_tokens`.

    Args:
        logprobs_train: [T], the trainer's log-prob of each sampled token (differentiable).
        logprobs_infer: [T], the inference engine's log-prob of the same tokens.
        advantages: [T], per-token advantages.
        loss_mask: bool [T], tokens that carry loss (completion tokens).
        num_loss_tokens: `loss_mask` tokens across the whole optimizer step (all micro-batches and ranks).
        config: eps / adv_tau / kl_tau (defaults: `RLLossConfig()`).
        entropy: optional [T] per-token entropy for the metrics.
        logits: optional [T, V], row t the distribution of token t, to compute the entropy when it is not given.

    Returns:
        The 0-d fp32 loss and detached 0-d metrics: `mismatch_kl` (= r - log r - 1) averaged over all / masked /
        unmasked loss tokens, `logprob_abs_error`, `masked_fraction`, `entropy` (when available), and the
        micro-batch counts `loss_tokens` and `masked_tokens` to weight them across micro-batches.
    """
    cfg = config or RLLossConfig()
    shape = logprobs_train.shape
    for name, t in (("logprobs_infer", logprobs_infer), ("advantages", advantages), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise InputError(f"{name} must have the shape of logprobs_train {tuple(shape)}, got {tuple(t.shape)}")
    lp_train, lp_infer = logprobs_train.float(), logprobs_infer.float()
    loss_mask = loss_mask.bool()
    log_ratio = lp_train - lp_infer
    with torch.no_grad():
        is_masked = (lp_train.exp() - lp_infer.exp()).abs() > cfg.eps
    keep = loss_mask & ~is_masked
    # Zero the log ratio off the kept tokens before exp: a huge ratio there would give inf * 0 = NaN gradients.
    log_ratio_kept = torch.where(keep, log_ratio, 0.0)
    ratio = log_ratio_kept.exp()
    per_token = -cfg.adv_tau * advantages.float() * ratio + cfg.kl_tau * log_ratio_kept.square()
    loss = _divide(torch.where(keep, per_token, 0.0).sum(), num_loss_tokens, "num_loss_tokens")
    metrics = _rl_metrics(log_ratio.detach(), loss_mask, is_masked, entropy, logits)
    return loss, metrics


@torch.no_grad()
def _rl_metrics(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    is_masked: torch.Tensor,
    entropy: torch.Tensor | None,
    logits: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    # In float64: in fp32, r - log r - 1 cancels to exactly 0 for |log r| below ~3e-4, hiding a real mismatch.
    log_ratio = log_ratio.double()
    mismatch_kl = log_ratio.exp() - log_ratio - 1
    masked, unmasked = loss_mask & is_masked, loss_mask & ~is_masked
    n_loss = loss_mask.sum()
    metrics = {
        "mismatch_kl": _masked_mean(mismatch_kl, loss_mask),
        "mismatch_kl_masked": _masked_mean(mismatch_kl, masked),
        "mismatch_kl_unmasked": _masked_mean(mismatch_kl, unmasked),
        "logprob_abs_error": _masked_mean(log_ratio.abs(), loss_mask),
        "masked_fraction": masked.sum() / n_loss.clamp_min(1),
        "loss_tokens": n_loss,
        "masked_tokens": masked.sum(),
    }
    if entropy is None and logits is not None:
        logp_TV = F.log_softmax(logits.float(), dim=-1)
        entropy = -(logp_TV.exp() * logp_TV).sum(-1)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.float(), loss_mask)
    return metrics
