"""One decoder layer: [PLE] -> hyper-mix -> GDN or QSA attention -> inject -> hyper-mix -> MoE -> inject."""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.config import LINEAR, TextConfig
from flashnext.model.attention import Attention
from flashnext.model.context import ContextShard
from flashnext.model.deltanet import GatedDeltaNet
from flashnext.model.hyper import GatedResidual, inject
from flashnext.model.moe import SparseMoE
from flashnext.model.ple import PLELayer
from flashnext.model.state import StepState, step_of


class DecoderLayer(nn.Module):
    """Layer `layer_idx` of the stack; `layer_idx=None` with a `layer_type` builds a layer outside the stack (the
    MTP head's: no PLE, which belongs to stack positions)."""

    def __init__(self, cfg: TextConfig, layer_idx: int | None, layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type or cfg.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg)
        one_based = None if layer_idx is None else layer_idx + 1
        self.ple = PLELayer(cfg, cfg.ple_layer_ids.index(one_based)) if one_based in cfg.ple_layer_ids else None
        args = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*args)
        self.mlp_hyper_connection = GatedResidual(*args)

    @property
    def mixer_name(self) -> str:
        """The attribute holding the token mixer: `linear_attn` (GDN) or `self_attn` (QSA)."""
        return "linear_attn" if self.layer_type == LINEAR else "self_attn"

    def state_spec(self, max_len: int) -> dict:
        """The per-sequence state of the layer's stateful parts, by attribute name (`ple`, and the mixer)."""
        spec = {self.mixer_name: getattr(self, self.mixer_name).state_spec(max_len)}
        if self.ple is not None:
            spec["ple"] = self.ple.state_spec(max_len)
        return spec

    def forward(
        self,
        residual: torch.Tensor,
        input_ids: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seg: Segments,
        replay: torch.Tensor | None = None,
        state: StepState[dict] | None = None,
        cp: ContextShard | None = None,
    ):
        """residual: [T, hc*D] -> ([T, hc*D], routed experts [T, k]). `input_ids` [T] are read by PLE only.

        `state` (serving): the layer's cached state by part name (`state_spec`); its parts continue their slots'
        sequences, and its step (`model.state.Step`) tells the parts which path to take: the prepared fast paths
        (`model.fused`) in serving, the static decode graph's shapes in `SparseMoE`.
        `cp` (context parallelism): this rank's slice of a stream shared with its group (`model.context`).
        """
        step = step_of(state)
        if self.ple is not None:
            residual = residual + self.ple(residual, input_ids, seg, None if state is None else state.part("ple"), cp)
        x, w = self.attn_hyper_connection(residual, step)
        mixer_state = None if state is None else state.part(self.mixer_name)
        if self.layer_type == LINEAR:
            x = self.linear_attn(x, seg, mixer_state, cp)
        else:
            x = self.self_attn(x, rope, seg, mixer_state, cp)
        residual = inject(residual, x, w)
        x, w = self.mlp_hyper_connection(residual, step)
        x, experts = self.mlp(x, replay, step)
        return inject(residual, x, w), experts
