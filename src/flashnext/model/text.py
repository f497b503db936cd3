"""The decoder stack and LM head (`FlashNextForCausalLM`), on flat token streams or padded batches.

Legend: B/S padded batch/sequence, T flat tokens, D hidden, hc streams, V vocab, L layers, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashnext.batch import Segments, flatten_inputs, integer_tensor
from flashnext.config import TextConfig
from flashnext.errors import InputError
from flashnext.model.context import ContextShard
from flashnext.model.deltanet import GatedDeltaNet
from flashnext.model.fused import apply_linear, linear
from flashnext.model.heads import CausalLMOutput, causal_lm_outputs, last_token_logits, last_token_rows
from flashnext.model.hyper import GatedResidual
from flashnext.model.layer import DecoderLayer
from flashnext.model.moe import Experts, Router
from flashnext.model.mtp import MultiTokenPredictor, mtp_inputs
from flashnext.model.ngram import NGramEmbedding
from flashnext.model.norm import GatedRMSNorm, RMSNorm
from flashnext.model.ple import PLELayer
from flashnext.model.rope import RotaryEmbedding
from flashnext.model.state import StepBatch, StepState, plan_blocks, step_of

MTP_OWN_HEAD = "mtp.shared_head.head.weight"  # a draft head of its own, when a checkpoint carries one


class FlashNextTextModel(nn.Module):
    """Embedding, L decoder layers over `hc` residual streams, final stream mixer. Flat in, flat out."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(
            cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, inject=False
        )
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)

    def state_spec(self, max_len: int) -> list[dict]:
        """Per layer, the per-sequence serving state of its stateful parts (see `model.state`)."""
        return [layer.state_spec(max_len) for layer in self.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        seg: Segments,
        replay: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        state: StepState[list] | None = None,
        cp: ContextShard | None = None,
    ):
        """input_ids: int [T] -> (hidden [T, D], routed experts int64 [T, L, k], residual [T, hc*D]).

        `residual` is the multi-stream residual after the last layer, before the final stream mixer (what the MTP
        head reads); `hidden` is the mixer's output.

        Args:
            replay: int [T, L, k] experts to force per layer (router replay).
            inputs_embeds: [T, D] (e.g. with image features scattered in) replaces the token embedding;
                `input_ids` are still required: PLE hashes the raw ids (image placeholders included).
            state: serving: the step and the cache's per-layer state (`StepState(step, cache.layers)`). The
                stream's sequences continue their slots' cached state, which is updated in place; the rotary uses
                `step.rope_positions` (MRoPE) when set, else the positions (cache rows).
            cp: context parallelism: the stream is this rank's slice of its group's stream (`model.context`);
                `seg.position_ids` are the tokens' positions in their whole sequences.
        """
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = x.repeat(1, self.config.hc_count)
        positions = seg.position_ids
        if state is not None:
            step = state.step
            positions = positions if step.rope_positions is None else step.rope_positions
            if self.config.qsa_enabled:
                step.blocks = plan_blocks(step, self.config.indexer_compress_ratio, self.rotary, x.dtype)
        rope = self.rotary(positions, x.dtype)
        routed = []
        for i, layer in enumerate(self.layers):
            layer_state = None if state is None else StepState(state.step, state.bufs[i])
            layer_replay = None if replay is None else replay[:, i]
            residual, experts = layer(residual, input_ids, rope, seg, layer_replay, layer_state, cp)
            routed.append(experts)
        hidden = self.hyper_connection_mixer(residual, step_of(state))
        return hidden, torch.stack(routed, dim=1), residual


class FlashNextForCausalLM(nn.Module):
    """Qwen3.8-Flash-Next text model. State-dict names equal the reference's in-memory names.

    The interface shared with `FlashNextForConditionalGeneration` (use these, never probe with `getattr`): the
    optional parts `mtp`, the MTP draft head (None when the config declares no MTP layer), and `visual`, the
    vision tower (always None here); `decoder`, the `FlashNextTextModel`.
    """

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.config = cfg
        self.model = FlashNextTextModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Registered last: `init_weights` draws module by module, so the trunk's values do not depend on it.
        self.mtp = MultiTokenPredictor(cfg) if cfg.mtp_layers else None
        self.visual: nn.Module | None = None  # text-only: no vision tower
        self.extra_tensors: dict[str, torch.Tensor] = {}

    @property
    def decoder(self) -> FlashNextTextModel:
        """The text decoder (embedding, layers, final mixer): `model` here, `model.language_model` in the composite."""
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        routed_experts: torch.Tensor | None = None,
        logprob_targets: torch.Tensor | None = None,
        return_logits: bool = True,
        return_mtp: bool = False,
        cp: ContextShard | None = None,
    ) -> CausalLMOutput:
        """Padded `[B, S]` ids (+ `attention_mask`), or flat `[T]` ids with `cu_seqlens` (`[N+1]`).

        Args:
            position_ids: `[B, S]` / `[T]`, or `[3, B, S]` / `[3, T]` MRoPE positions; default: the offset of
                each token in its sequence.
            labels: same layout as `input_ids`; the loss predicts `labels[t+1]` from token t within a sequence
                (-100 = no loss), averaged over all label tokens.
            routed_experts: int [T, L, k] (flat order) to replay the router's expert choice.
            logprob_targets: same layout as `input_ids`, a vocabulary id per row (already shifted: row t's target
                is scored by row t's distribution): `out.logprobs` and `out.entropy`.
            return_logits: False computes the loss / log-probs without materialising the [T, V] logits
                (`ops.lm_head`, row chunks; `out.logits` is None). The numbers equal the logits path to fp32
                rounding.
            return_mtp: also run the MTP head over the stream (`mtp_logits`; `mtp_loss` with labels: position t
                predicts `labels[t+2]` within a sequence). The trunk's outputs are the same either way.
            cp: context parallelism (`flashnext.parallel.context`): the flat ids are this rank's slice of its
                group's stream, `cu_seqlens` the slice's own boundaries and `position_ids` the global positions.
                `labels` are the slice's own (unshifted) labels: the heads shift them, and the MTP head its next
                tokens, across the slice's right edge (`cp.next_rows`); `loss_sum` is then this slice's part of
                the stream's sum (`loss` its mean over this slice's targets).

        An empty batch (`[0, S]` or `[0]` ids) returns empty logits (`[0, S, V]` / `[0, V]`).

        Raises:
            InputError: naming the argument, shape or dtype (see `flashnext.batch.flatten_inputs`), ids outside
                the vocabulary, `routed_experts` that are not `[T, L, k]` integers, or `return_mtp` without an
                MTP head.
        """
        if cp is not None and input_ids.dim() != 1:
            raise InputError(f"with cp, pass flat [T] input_ids (got shape {tuple(input_ids.shape)})")
        inputs = flatten_inputs(
            input_ids, attention_mask, cu_seqlens=cu_seqlens, position_ids=position_ids, labels=labels,
            logprob_targets=logprob_targets,
        )  # fmt: skip
        self._check_ids(inputs.ids)
        self._check_replay(routed_experts, inputs.ids.shape[0])
        return causal_lm_outputs(self, inputs, inputs.seg, routed_experts, None, return_logits, return_mtp, cp)

    def mtp_logits(self, residual: torch.Tensor, input_ids: torch.Tensor, seg: Segments) -> torch.Tensor:
        """The MTP head over a whole stream (training): residual [T, hc*D], ids [T] -> draft logits [T, V]."""
        return F.linear(self.mtp_hidden(residual, input_ids, seg), self.mtp_head_weight())

    def mtp_hidden(self, residual: torch.Tensor, input_ids: torch.Tensor, seg: Segments) -> torch.Tensor:
        """The MTP head's final hidden states over a whole stream: residual [T, hc*D], ids [T] -> [T, D]."""
        rope = self.decoder.rotary(seg.position_ids, residual.dtype)
        embeds = self.decoder.embed_tokens(mtp_inputs(input_ids, seg))
        _, y = self.mtp(residual, embeds, rope, seg)
        return y

    def mtp_head_weight(self) -> torch.Tensor:
        """The draft head's LM head: the model's `lm_head` (shared), unless the checkpoint carried its own
        `mtp.shared_head.head.weight` (kept in `extra_tensors`)."""
        own = self.extra_tensors.get(MTP_OWN_HEAD)
        if own is None:
            return self.lm_head.weight
        w = self.lm_head.weight
        if own.device != w.device or own.dtype != w.dtype:
            own = self.extra_tensors[MTP_OWN_HEAD] = own.to(w.device, w.dtype)
        return own

    def state_spec(self, max_len: int) -> list[dict]:
        """Per layer, the per-sequence serving state of its stateful parts (what `StateCache` allocates): the
        trunk's layers, then the MTP head's (its cache of cells) when the model has one."""
        mtp = [] if self.mtp is None else self.mtp.state_spec(max_len)
        return self.decoder.state_spec(max_len) + mtp

    @torch.no_grad()
    def forward_step(
        self,
        input_ids: torch.Tensor,
        step: StepBatch,
        cache,
        inputs_embeds: torch.Tensor | None = None,
        *,
        return_routing: bool = False,
        rows: torch.Tensor | None = None,
        with_residual: bool = False,
    ):
        """One serving step over a flat stream of prefill chunks and decode tokens: `forward` with state.

        Args:
            input_ids: int [T], the entries' new tokens back to back.
            step: the entries' slots and cached lengths (`flashnext.model.state.make_step`).
            cache: the `flashnext.serve.cache.StateCache` the entries' state lives in; updated in place. The model
                must have been prepared for serving (`flashnext.serve.prepare_for_inference`).
            inputs_embeds: optional [T, D] replacing the token embedding (see `FlashNextTextModel.forward`).
            rows: int64 [R] stream indices whose logits to return instead (e.g. every verified position of a
                speculative entry).
            with_residual: also return the pre-final-mixer residual [T, hc*D] of every token (the MTP head's input).
            return_routing: also return the experts every token of the stream was routed to (router replay).

        Returns:
            logits [n_live, V] of the last token of every live entry (real slot, at least one token), in entry
            order (padding and zero-length entries produce no row; a static step returns all N rows, padding
            included), or [R, V] for `rows`. With `with_residual` and/or `return_routing`, a tuple
            `(logits, residual)`, `(logits, routed)` or `(logits, residual, routed)` (routed: int64 [T, L, k], the
            same expert ids `forward` returns for these tokens).
        """
        state = StepState(step, cache.layers)
        hidden, routed, residual = self.decoder(input_ids, step.seg, inputs_embeds=inputs_embeds, state=state)
        if rows is None:
            logits = last_token_logits(self.lm_head, hidden, step)
        else:
            logits = apply_linear(self.lm_head, hidden.index_select(0, rows), fused=True, contiguous=False)
        extras = ((residual,) if with_residual else ()) + ((routed,) if return_routing else ())
        return (logits, *extras) if extras else logits

    @torch.no_grad()
    def draft_step(
        self, residual: torch.Tensor, next_ids: torch.Tensor, step: StepBatch, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One serving step of the MTP head over a flat stream of cells (see `model.mtp`).

        Args:
            residual: [T, hc*D] each cell's `R_i` (trunk residual rows, or the previous draft step's `R_next`).
            next_ids: int64 [T] each cell's next token `x_{i+1}`.
            step: the cells' entries: slot and first cell position (`cached`) per entry (`make_step`; with the
                requests' `mrope` for an image prompt: each cell rotates at its token's MRoPE position).
            cache: the `StateCache`; the head's cache of cells (after the trunk's layers) is updated in place.

        Returns:
            (draft logits [n_live, V] of the last cell of every live entry, R_next [T, hc*D]).
        """
        if self.mtp is None:
            raise InputError("draft_step: this model has no MTP head (its config declares no MTP layer)")
        dtype, decoder = residual.dtype, self.decoder
        if self.config.qsa_enabled:
            step.blocks = plan_blocks(step, self.config.indexer_compress_ratio, decoder.rotary, dtype)
        positions = step.seg.position_ids if step.rope_positions is None else step.rope_positions  # MRoPE
        rope = decoder.rotary(positions, dtype)
        state = StepState(step, cache.layers[len(decoder.layers) :])
        r_next, y = self.mtp(residual, decoder.embed_tokens(next_ids), rope, step.seg, state)
        last = last_token_rows(y, step)
        if MTP_OWN_HEAD not in self.extra_tensors:  # the shared head (an int8 module once quantized)
            return apply_linear(self.lm_head, last, fused=True, contiguous=False), r_next
        return linear(last, self.mtp_head_weight(), fused=True, contiguous=False), r_next

    def _check_replay(self, routed_experts: torch.Tensor | None, num_tokens: int) -> None:
        """Host-side shape/dtype check of a router replay, int [T, L, k] (expert ids' range: the data loader's job)."""
        if routed_experts is None:
            return
        integer_tensor("routed_experts", routed_experts)
        want = (num_tokens, self.config.num_hidden_layers, self.config.num_experts_per_tok)
        if tuple(routed_experts.shape) != want:
            raise InputError(
                f"routed_experts must be [T, L, k] = {list(want)} (tokens in flat order, layers, experts per token), "
                f"got shape {tuple(routed_experts.shape)}"
            )

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Every id in [0, vocab_size) (ids are int64 here, so the bound cannot wrap); one device read."""
        if ids.device.type == "meta" or ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0])
            raise InputError(
                f"input_ids[{pos}]={int(ids[pos])} is outside the vocabulary [0, {self.config.vocab_size})"
            )

    # ---- weights ---------------------------------------------------------------------------------------
    def reset_buffers(self) -> None:
        """Recompute derived (non-persistent) buffers, e.g. after `to_empty` from the meta device."""
        for m in self.modules():
            if isinstance(m, NGramEmbedding):
                m.reset_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Random init as the reference does (normal(0, initializer_range); norms at their identity)."""
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        init_modules(self, WholeTensorInit(gen, self.config.initializer_range))


class WholeTensorInit:
    """How `init_modules` writes a value: whole tensors, drawn from `gen` (None: torch's global generator).
    `parallel/init.py` subclasses it to keep only a rank's shard of the same draws."""

    def __init__(self, gen: torch.Generator | None, std: float):
        self.gen, self.std = gen, std

    def made(self, p: torch.Tensor, make) -> None:
        """Write `make(shape)` into `p`."""
        p.copy_(make(tuple(p.shape)))

    def normal(self, p: torch.Tensor) -> None:
        self.made(p, lambda shape: torch.randn(shape, generator=self.gen) * self.std)

    def const(self, p: torch.Tensor, value: float) -> None:
        p.fill_(value)

    def module(self, m: nn.Module) -> bool:
        """Initialise a module the ladder does not know (True: done); none here."""
        return False


@torch.no_grad()
def init_modules(model: nn.Module, init: WholeTensorInit) -> None:
    """The init ladder, module by module in `model.modules()` order (every draw comes from one generator, so the
    order is part of the values): normal(0, std) weights, norms at their identity, the delta rule's decay and bias
    as the reference sets them. Derived buffers are recomputed (`reset_buffers`)."""
    for m in model.modules():
        if init.module(m):
            continue
        if isinstance(m, nn.Linear | nn.Embedding):
            init.normal(m.weight)
        elif isinstance(m, Experts):
            init.normal(m.gate_up_proj)
            init.normal(m.down_proj)
        elif isinstance(m, Router):
            init.normal(m.weight)
        elif isinstance(m, RMSNorm):
            init.const(m.weight, 0.0)
        elif isinstance(m, GatedRMSNorm):
            init.const(m.weight, 1.0)
        elif isinstance(m, GatedDeltaNet):
            init.const(m.dt_bias, 1.0)
            init.made(m.A_log, lambda shape: torch.empty(shape).uniform_(0.01, 16, generator=init.gen).log())
            init.normal(m.conv1d.weight)
        elif isinstance(m, PLELayer):
            init.const(m.conv1d.weight, 0.0)
    model.reset_buffers()
