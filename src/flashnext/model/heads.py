"""The LM head's outputs of a training forward, shared by the text and the composite model: the text path after
the inputs are flattened (`causal_lm_outputs`: decoder, `head_outputs`, `mtp_outputs`), the `CausalLMOutput` it
returns, and the serving steps' last-token logits (`last_token_logits`).

Legend: B/S padded batch/sequence, T flat tokens, D hidden, hc streams, V vocab, L layers, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import ModelInputs, Segments, next_token_targets
from flashnext.errors import InputError
from flashnext.model.context import ContextShard
from flashnext.model.fused import apply_linear
from flashnext.model.state import StepBatch
from flashnext.ops import lm_head as lm_head_ops


@dataclass
class CausalLMOutput:
    """A forward's outputs (per-token ones in the caller's layout: [B, S, ...] padded, [T, ...] flat).

    Attributes:
        logits: [B, S, V] / [T, V]; None when the forward was asked for losses only (`return_logits=False`).
        loss: mean next-token CE over label tokens (fp32), with `labels`.
        routed_experts: int64 [T, L, k] (flat order).
        loss_sum: the fp32 CE summed over the label tokens (what `loss` averages), with `labels`.
        logprobs, entropy: fp32 [B, S] / [T], with `logprob_targets`: the log-prob of each row's target and the
            entropy of the row's distribution.
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mtp_logits: torch.Tensor | None = None
    mtp_loss: torch.Tensor | None = None
    mtp_loss_sum: torch.Tensor | None = None


def causal_lm_outputs(
    model,
    inputs: ModelInputs,
    seg: Segments,
    routed_experts: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    return_logits: bool,
    return_mtp: bool,
    cp: ContextShard | None = None,
) -> CausalLMOutput:
    """The text path of a training forward, shared by the text and the composite model once their inputs are
    flattened and checked: the decoder over `inputs.ids` (embedded as `inputs_embeds` when given) under `seg` (the
    inputs' own segments, or the composite's with MRoPE positions: the same sequences), then the LM head's outputs
    (`head_outputs`) and, with `return_mtp`, the MTP head's (`mtp_outputs`). Args as `FlashNextForCausalLM.forward`.

    Raises:
        InputError: `return_mtp` on a model without an MTP head.
    """
    if return_mtp and model.mtp is None:
        raise InputError("return_mtp=True but this model has no MTP head (its config declares no MTP layer)")
    hidden, experts, residual = model.decoder(inputs.ids, seg, routed_experts, inputs_embeds=inputs_embeds, cp=cp)
    shift = _shifter(seg, cp)
    out = head_outputs(model.lm_head, hidden, inputs, experts, return_logits, shift)
    if return_mtp:
        seg_inputs = inputs if seg is inputs.seg else replace(inputs, seg=seg)
        mtp_outputs(model, out, residual, seg_inputs, return_logits, shift, cp)
    return out


def mtp_outputs(model, out: CausalLMOutput, residual: torch.Tensor, inputs: ModelInputs, return_logits: bool,
                shift, cp: ContextShard | None = None) -> None:  # fmt: skip
    """Fill `out.mtp_logits` / `out.mtp_loss` of `model` (a causal LM or the composite model, with `mtp`) from the
    trunk's residual [T, hc*D]; without `return_logits` the draft loss comes from the chunked head
    (`ops.lm_head`) and `mtp_logits` stays None. `shift(x, fill)`: the within-sequence next row (across the slice's
    edge under `cp`). The head embeds each cell's next token id (image placeholders included: the draft step of a
    served image prompt then needs no image features)."""
    decoder = model.decoder
    rope = decoder.rotary(inputs.seg.position_ids, residual.dtype)
    _, y = model.mtp(residual, decoder.embed_tokens(shift(inputs.ids, 0)), rope, inputs.seg, cp=cp)
    weight, labels = model.mtp_head_weight(), inputs.per_token["labels"]
    if return_logits:
        mtp_logits = F.linear(y, weight)
        out.mtp_logits = inputs.pad_back(mtp_logits)
    if labels is None:
        return
    tgt = shift(shift(labels, -100), -100)  # labels[t + 2] within the sequence (`mtp.mtp_targets`)
    if return_logits:
        out.mtp_loss_sum = F.cross_entropy(mtp_logits.float(), tgt, ignore_index=-100, reduction="sum")
    else:
        out.mtp_loss_sum = lm_head_ops.linear_cross_entropy(y, weight, tgt)
    out.mtp_loss = out.mtp_loss_sum / (tgt != -100).sum()


def last_token_rows(hidden: torch.Tensor, step: StepBatch) -> torch.Tensor:
    """The rows [n_live, D] of the last token of every live entry of a serving step. hidden: [T, D].

    A static step returns every entry's row, padding included ([N, D]; the caller drops the padding rows): which
    entries are live is a device tensor there, and reading it would be a host sync inside the compiled step."""
    if step.static:  # every entry's last token (at one token per entry: every row)
        L = step.seg.max_seqlen
        return hidden if L == 1 else hidden[L - 1 :: L]
    last = [b - 1 for b, live in zip(step.seg.cu_host[1:], step.live_host, strict=True) if live]
    if len(last) < hidden.shape[0]:  # else every token is a live entry's last (a decode step): all rows
        hidden = hidden.index_select(0, torch.tensor(last, dtype=torch.long, device=hidden.device))
    return hidden


def last_token_logits(lm_head: nn.Module, hidden: torch.Tensor, step: StepBatch) -> torch.Tensor:
    """Logits [n_live, V] of the last token of every live entry of a serving step. hidden: [T, D]."""
    return apply_linear(lm_head, last_token_rows(hidden, step), fused=True, contiguous=False)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Next-token CE within each sequence, in fp32, averaged over label tokens. logits [T, V], labels [T]."""
    nxt = next_token_targets(labels, seg)
    return F.cross_entropy(logits.float(), nxt, ignore_index=-100, reduction="sum") / (nxt != -100).sum()


def _shifter(seg: Segments, cp: ContextShard | None):
    """`shift(x, fill)`: each row's next row within its sequence (`fill` at the last): `next_token_targets` on the
    stream, or `cp.next_rows` across a context-parallel slice's right edge."""
    if cp is None:
        return lambda x, fill: next_token_targets(x, seg, fill)
    return cp.next_rows


def head_outputs(
    lm_head: nn.Linear,
    hidden: torch.Tensor,
    inputs: ModelInputs,
    experts: torch.Tensor,
    return_logits: bool,
    shift=None,
) -> CausalLMOutput:
    """The LM head's outputs of a forward: logits, and the loss / target log-probs the inputs ask for.

    With `return_logits` the logits [T, V] are materialised and the losses computed from them (the plain path);
    without, `ops.lm_head` computes them in row chunks (the fast path: no [T, V] tensor; equal to fp32 rounding).

    Args:
        hidden: [T, D] the final hidden states; inputs: the forward's `ModelInputs` (`labels`,
            `logprob_targets` in `per_token`); experts: the routed experts to pass through.
        shift: `shift(labels, -100)` -> next-token targets (default: within `inputs.seg`; see `_shifter`).
    """
    labels, targets = inputs.per_token.get("labels"), inputs.per_token.get("logprob_targets")
    logits = lm_head(hidden) if return_logits else None
    out = CausalLMOutput(logits=None if logits is None else inputs.pad_back(logits), routed_experts=experts)
    if labels is not None:
        nxt = shift(labels, -100) if shift is not None else next_token_targets(labels, inputs.seg)
        if logits is not None:
            out.loss_sum = F.cross_entropy(logits.float(), nxt, ignore_index=-100, reduction="sum")
        else:
            out.loss_sum = lm_head_ops.linear_cross_entropy(hidden, lm_head.weight, nxt)
        out.loss = out.loss_sum / (nxt != -100).sum()
    if targets is not None:
        targets = targets.long()
        if logits is not None:
            logp = F.log_softmax(logits.float(), dim=-1)
            lp, entropy = logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
        else:
            lp, entropy = lm_head_ops.linear_logprobs(hidden, lm_head.weight, targets)
        out.logprobs, out.entropy = inputs.pad_back(lp), inputs.pad_back(entropy)
    return out
