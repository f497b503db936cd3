"""One decoder layer: [PLE] -> hyper-mix -> GDN or QSA attention -> inject -> hyper-mix -> MoE -> inject."""

from __future__ import annotations

import torch
from torch import nn

from flashnext.batch import Segments
from flashnext.config import LINEAR, TextConfig
from flashnext.model.attention import Attention
from flashnext.model.cached import StepBatch
from flashnext.model.deltanet import GatedDeltaNet
from flashnext.model.hyper import GatedResidual, inject
from flashnext.model.moe import SparseMoE
from flashnext.model.ple import PLELayer


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg)
        one_based = layer_idx + 1
        self.ple = PLELayer(cfg, cfg.ple_layer_ids.index(one_based)) if one_based in cfg.ple_layer_ids else None
        args = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*args)
        self.mlp_hyper_connection = GatedResidual(*args)

    def forward(
        self,
        residual: torch.Tensor,
        input_ids: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        seg: Segments,
        replay: torch.Tensor | None = None,
    ):
        """residual: [T, hc*D] -> ([T, hc*D], routed experts [T, k])."""
        if self.ple is not None:
            residual = residual + self.ple(residual, input_ids, seg)
        x, w = self.attn_hyper_connection(residual)
        if self.layer_type == LINEAR:
            x = self.linear_attn(x, seg)
        else:
            x = self.self_attn(x, *rope, seg)
        residual = inject(residual, x, w)
        x, w = self.mlp_hyper_connection(residual)
        x, experts = self.mlp(x, replay)
        return inject(residual, x, w), experts

    def forward_cached(
        self,
        residual: torch.Tensor,
        input_ids: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        step: StepBatch,
        cache,
    ) -> torch.Tensor:
        """Serving: as `forward`, with the stateful mixers continuing from `cache` (a `LayerCache`)."""
        if self.ple is not None:
            residual = residual + self.ple.forward_cached(residual, input_ids, step, cache.ple)
        x, w = self.attn_hyper_connection(residual)
        if self.layer_type == LINEAR:
            x = self.linear_attn.forward_cached(x, step, cache.gdn)
        else:
            x = self.self_attn.forward_cached(x, *rope, step, cache.qsa)
        residual = inject(residual, x, w)
        x, w = self.mlp_hyper_connection(residual)
        x, _ = self.mlp(x)
        return inject(residual, x, w)
