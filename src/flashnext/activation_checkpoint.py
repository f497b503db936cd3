"""Activation checkpointing applied from outside the model: non-reentrant, one region per decoder layer.

The layer's `forward` is replaced on the instance (not wrapped in another module), so parameter names and the
checkpoint layout stay exactly those of the plain model. Recomputation is exact: every choice a layer makes
(QSA block selection, MoE top-k) is deterministic, so the backward recompute selects the same tokens/experts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint every decoder layer of `model` (`FlashNextForCausalLM` or the composite
    `FlashNextForConditionalGeneration`: the layers of `model.decoder`). Returns the number of layers
    wrapped.

    Idempotent: a layer already wrapped is left as is.
    """
    wrapped = 0
    decoder = model.decoder
    for layer in decoder.layers:
        if getattr(layer, "_flashnext_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._flashnext_checkpointed = True
        wrapped += 1
    return wrapped
