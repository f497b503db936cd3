"""What a training step minimises: the run's loss on one micro-batch, plus the MTP head's auxiliary loss.

An `Objective` maps (model, micro-batch, the step's token counts) to `(loss, metrics, mtp_loss or None)`:
- `CrossEntropy`: SFT, the summed next-token cross-entropy over the labels;
- `InferenceIPO`: RL, the IPO policy loss against the inference engine's log-probs and the advantages (and the
  train/inference mismatch KL among its metrics);
- `WithMTP(main, ...)`: `main` plus the MTP head's loss from the same forward (`return_mtp=True`).
Each loss is a sum divided by a count over the whole step (`loss.step_mean`), so the micro-batch losses add up to the
step mean. The model computes the losses or the target log-probs without materialising the [T, V] logits
(`return_logits=False`: the LM heads run in row chunks fused with the loss, `ops.lm_head`). A context-parallel
slice (`ContextBatch`) takes the same path with `cp=`: the model shifts its labels across the slice's edge, so
the main and the MTP losses are this slice's part of the stream's sums.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from flashnext.batch import PackedBatch, make_segments, next_token_targets
from flashnext.parallel.context import ContextBatch
from flashnext.train.config import RunConfig
from flashnext.train.loss import IGNORE_INDEX, RLLossConfig, rl_loss, step_mean, token_logprobs

Metrics = dict[str, torch.Tensor]


class Objective(Protocol):
    def __call__(
        self, model: torch.nn.Module, b: PackedBatch | ContextBatch, num_loss_tokens: float, num_mtp_tokens: float = 0.0
    ) -> tuple[torch.Tensor, Metrics, torch.Tensor | None]:
        """(the loss, its metrics, the MTP head's loss or None) of one micro-batch."""
        ...


def _inputs(b: PackedBatch, device: torch.device, mtp: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(input ids, labels, the forward's keyword arguments) of a packed micro-batch, on `device`; `mtp`: the
    forward also returns the MTP head's loss sum."""
    pos = b.position_ids.to(device)
    replay = b.routed_experts.to(device) if b.routed_experts is not None else None
    kwargs = dict(cu_seqlens=b.cu_seqlens, position_ids=pos, routed_experts=replay, return_logits=False)
    kwargs.update(b.image_kwargs(device), **({"return_mtp": True} if mtp else {}))
    return b.input_ids.to(device), b.labels.to(device), kwargs


def _context_inputs(b: ContextBatch, mtp: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """`_inputs` of a CP rank's slice: its ids, its own labels (unshifted) and `cp=` its shard."""
    kwargs = dict(cu_seqlens=b.cu_seqlens, position_ids=b.position_ids, routed_experts=b.routed_experts,
                  return_logits=False, cp=b.shard)  # fmt: skip
    return b.input_ids, b.labels, {**kwargs, **({"return_mtp": True} if mtp else {})}


class CrossEntropy:
    """SFT: the summed cross-entropy of the labelled tokens over the step's label count."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, model, b, num_loss_tokens: float, mtp: bool = False):
        cp = isinstance(b, ContextBatch)
        ids, labels, kwargs = _context_inputs(b, mtp) if cp else _inputs(b, self.device, mtp)
        out = model(ids, labels=labels, **kwargs)
        return step_mean(out.loss_sum, num_loss_tokens), {}, out


class InferenceIPO:
    """RL: the IPO loss of the trainer's log-probs against the inference engine's (`loss.rl_loss`), with metrics.

    Log-probs are those of `softmax(logits / rl.temperature)`; at temperature 1 the chunked head gives them directly,
    otherwise they come from the logits."""

    def __init__(self, device: torch.device, rl: RLLossConfig):
        self.device, self.rl = device, rl

    def __call__(self, model, b, num_loss_tokens: float, mtp: bool = False):
        if isinstance(b, ContextBatch):  # shifted on the whole stream before slicing
            ids, labels, kwargs = _context_inputs(b, mtp)
            targets, lp_infer, adv = b.targets, b.inference_logprobs, b.advantages
        else:
            dev = self.device
            ids, labels, kwargs = _inputs(b, dev, mtp)
            seg = make_segments(b.cu_seqlens, ids.shape[0], kwargs["position_ids"], device=dev)
            targets = next_token_targets(labels, seg, IGNORE_INDEX)
            lp_infer = next_token_targets(b.inference_logprobs.to(dev), seg, 0.0)  # aligned with the prediction at t
            adv = next_token_targets(b.advantages.to(dev), seg, 0.0)
        # labels only for the MTP head's targets (the main head then also sums a CE nobody reads: one chunked pass)
        mtp_labels = {"labels": labels} if mtp else {}
        mask = targets != IGNORE_INDEX
        if self.rl.temperature != 1.0:  # the chunked head's log-probs are T = 1's: these go through the logits
            out = model(ids, **mtp_labels, **{**kwargs, "return_logits": True})
            return (*self._from_logits(out.logits, targets, lp_infer, adv, num_loss_tokens), out)
        out = model(ids, logprob_targets=torch.where(mask, targets, 0), **mtp_labels, **kwargs)
        loss, metrics = rl_loss(out.logprobs, lp_infer, adv, mask, num_loss_tokens, self.rl, entropy=out.entropy)
        return loss, metrics, out

    def _from_logits(self, logits, targets, lp_infer, adv, num_loss_tokens: float):
        mask = targets != IGNORE_INDEX
        lp_train, entropy = token_logprobs(logits, torch.where(mask, targets, 0), self.rl.temperature)
        return rl_loss(lp_train, lp_infer, adv, mask, num_loss_tokens, self.rl, entropy=entropy)


class Alone:
    """A main objective by itself (no auxiliary loss)."""

    def __init__(self, main):
        self.main = main

    def __call__(self, model, b, num_loss_tokens, num_mtp_tokens=0.0):
        loss, metrics, _ = self.main(model, b, num_loss_tokens)
        return loss, metrics, None


class WithMTP:
    """`main` plus the MTP head's loss (mean over the step's MTP targets) from the same forward (under context
    parallelism the model forms its targets, two tokens ahead, across the slice's edge)."""

    def __init__(self, main):
        self.main = main

    def __call__(self, model, b, num_loss_tokens, num_mtp_tokens=0.0):
        loss, metrics, out = self.main(model, b, num_loss_tokens, mtp=True)
        return loss, metrics, step_mean(out.mtp_loss_sum, num_mtp_tokens, "num_mtp_tokens")


def build_objective(cfg: RunConfig, device: torch.device) -> Objective:
    """The run's objective: `train.loss` (SFT or RL), with the MTP loss when `train.mtp_loss_weight > 0`."""
    main = CrossEntropy(device) if cfg.train.loss == "sft" else InferenceIPO(device, cfg.rl)
    return WithMTP(main) if cfg.train.mtp_loss_weight > 0 else Alone(main)
