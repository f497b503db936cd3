"""One token of the gated delta rule for a batch of sequences: the decode path of `ops.deltanet_ref`.

Legend: N sequences (one token each), H value heads, K key dim, V value dim. State S: fp32 [N, H, K, V].
Same per-token math as `recurrent_gated_delta_rule`, batched over N without a Python loop.
"""

from __future__ import annotations

import torch

from flashnext.ops.deltanet_ref import prepare_qk


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N states by one token each.

    Args:
        q, k: [N, H, K] raw (L2-normalised and q-scaled here); v: [N, H, V]; g, beta: [N, H].
        state: fp32 [N, H, K, V], the state before the token.

    Returns:
        o [N, H, V] in v's dtype and the new fp32 state [N, H, K, V].
    """
    out_dtype = v.dtype
    q, k = prepare_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    S = state.float() * g.exp()[..., None, None]
    pred = (S * k[..., :, None]).sum(-2)
    delta = (v - pred) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    o = (S * q[..., :, None]).sum(-2)
    return o.to(out_dtype), S
