"""One token of the gated delta rule for a batch of sequences: the decode path of `ops.deltanet_ref`.

Legend: N sequences (one token each), H value heads, K key dim, V value dim. State S: fp32 [N, H, K, V].
Same per-token math as `recurrent_gated_delta_rule`, batched over N without a Python loop; the state products
run as batched matrix-vector products (`bmm`/`baddbmm`), three passes over the state; traced by dynamo (a compiled
decode step) as broadcast sums that inductor fuses into two (`_step_sums`).
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
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance N states by one token each.

    Args:
        q, k: [N, H, K] raw (L2-normalised and q-scaled here); v: [N, H, V]; g, beta: [N, H].
        state: fp32 [N, H, K, V], the state before the token.
        in_place: write the new state over `state` (contiguous fp32; read fully before it is overwritten).

    Returns:
        o [N, H, V] in v's dtype and the new fp32 state [N, H, K, V].
    """
    q, k = prepare_qk(q, k)
    o, S = prepared_delta_step(q, k, v, g.float().exp(), beta, state, in_place)
    return o.to(v.dtype), S


def prepared_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_step` on inputs already prepared (`prepare_qk`'s q and k, `decay` = exp(g) in fp32), so a
    caller stepping through several positions prepares them once. Returns o in fp32 and the new state."""
    if torch.compiler.is_dynamo_compiling():
        return _step_sums(q, k, v.float(), decay, beta.float(), state, in_place)
    N, H, K = k.shape
    V = v.shape[-1]
    S = state.float().reshape(N * H, K, V)
    # k^T (decay * S) as decay * (k^T S): one batched matvec over the old state instead of a scaled copy first.
    pred = torch.bmm(k.reshape(N * H, 1, K), S).view(N, H, V) * decay[..., None]
    delta = (v.float() - pred) * beta.float()[..., None]
    out = S if in_place else None
    S = torch.baddbmm(S * decay.reshape(N * H, 1, 1), k.reshape(N * H, K, 1), delta.view(N * H, 1, V), out=out)
    o = torch.bmm(q.reshape(N * H, 1, K), S).view(N, H, V)
    return o, S.view(N, H, K, V)


def _step_sums(q, k, v, decay, beta, state, in_place: bool):
    """`gated_delta_step`'s products as broadcast sums, for inductor (a compiled decode step): the matvecs and the
    rank-1 update fuse into two passes over the state (one reading it for `pred`, one writing the new state and
    summing the output) instead of three extern `bmm`/`baddbmm` calls and a scaled copy. Same math, fp32, another
    summation order."""
    S = state.float()  # [N, H, K, V]
    pred = (k[..., :, None] * S).sum(-2) * decay[..., None]  # [N, H, V]
    delta = (v - pred) * beta[..., None]
    new = S * decay[..., None, None] + k[..., :, None] * delta[..., None, :]
    o = (q[..., :, None] * new).sum(-2)
    if in_place:
        state.copy_(new)
        new = state
    return o, new
