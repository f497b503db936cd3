"""One token of the gated delta rule for a batch of sequences: the decode path of `ops.deltanet_ref`.

Legend: N sequences (one token each), H value heads, K key dim, V value dim. State S: fp32 [N, H, K, V].
Same per-token math as `recurrent_gated_delta_rule`, batched over N without a Python loop; the state products
run as batched matrix-vector products (`bmm`/`baddbmm`), three passes over the state; traced by dynamo (a compiled
decode step) as broadcast sums that inductor fuses into two (`_step_sums`).

A few tokens per sequence (a speculative verify step) step position by position: `short_gated_delta_rule`, and
`equal_short_gated_delta_rule` for sequences of one length (optionally keeping the state after every position).
"""

from __future__ import annotations

import torch

from flashnext.batch import Segments
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


def short_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seg: Segments,
    initial_state: torch.Tensor,
    positions: bool = False,
):
    """Short sequences continuing states: `gated_delta_step` at each position t, over the sequences longer than t.

    Args/returns as `gated_delta_rule` (`initial_state` required, not modified); `positions`: also the states after
    each position, fp32 [max_seqlen, N, H, K, V] (a sequence shorter than t + 1 keeps its final state at t).
    """
    if len(set(seg.lengths)) == 1 and initial_state.shape[0] == len(seg.lengths):
        return equal_short_gated_delta_rule(q, k, v, g, beta, initial_state, positions)
    starts, lengths = seg.cu_host[:-1], seg.lengths
    S = initial_state.float().clone()
    o = v.new_empty(v.shape)
    everyone = torch.arange(len(lengths), device=v.device)
    states = S.new_empty(seg.max_seqlen, *S.shape) if positions else None
    for t in range(seg.max_seqlen):
        live = [n for n, length in enumerate(lengths) if length > t]
        at = torch.tensor([starts[n] + t for n in live], dtype=torch.long, device=v.device)
        idx = everyone if len(live) == len(lengths) else torch.tensor(live, dtype=torch.long, device=v.device)
        pick = [x.index_select(0, at) for x in (q, k, v, g, beta)]
        o_t, s_t = gated_delta_step(*pick, S.index_select(0, idx))
        o.index_copy_(0, at, o_t)
        S.index_copy_(0, idx, s_t)
        if states is not None:
            states[t] = S
    return (o, S) if states is None else (o, S, states)


def equal_short_gated_delta_rule(q, k, v, g, beta, initial_state, positions: bool = False):
    """`short_gated_delta_rule` when every sequence has the same length L (a batch-1 verify step, or every request
    verifying as many drafts): the per-token preparation (`prepare_qk`, exp(g), fp32 casts) runs once over the
    stream and is laid out position-major ([L, N*H, ...], one copy when N > 1, none at N = 1) and split into its
    L positions once; each position is then seven calls on the state, stepped in place (an eager verify step is
    bound by calls: the general step's reshapes, slices and temporaries were ~25 a position). Same arithmetic per
    position as `prepared_delta_step` (its products and elementwise steps in its order).

    `positions`: also return the state after every position, fp32 [L, N, H, K, V] (each position then steps into
    its own buffer instead of one stepped in place; a verify step keeps the accepted prefix's, `serve.speculative`).
    """
    N = initial_state.shape[0]
    T, H, K = k.shape
    L, V = T // N, v.shape[-1]
    qp, kp = prepare_qk(q, k)

    def split(x: torch.Tensor, shape: tuple[int, int]):  # [T, H, ...] -> L views [N*H, *shape]
        if N == 1:
            return x.view(L, H, *shape).unbind(0)
        return x.view(N, L, H, -1).transpose(0, 1).reshape(L, N * H, *shape).unbind(0)

    ks, qs = split(kp, (1, K)), split(qp, (1, K))
    kcols = [x.view(N * H, K, 1) for x in ks]
    vs = split(v.float(), (1, V))
    decays, betas = split(g.float().exp(), (1, 1)), split(beta.float(), (1, 1))
    S = initial_state.float().reshape(N * H, K, V)
    states = torch.empty(L, N * H, K, V, device=v.device) if positions else None
    S = S if positions else S.clone()  # kept: each position steps into its own buffer, the input read at t = 0
    o = torch.empty(L, N * H, 1, V, dtype=torch.float32, device=v.device)
    for t, o_t in enumerate(o.unbind(0)):
        pred = torch.bmm(ks[t], S).mul_(decays[t])  # k^T (decay * S) as decay * (k^T S), as the step
        delta = torch.sub(vs[t], pred, out=pred).mul_(betas[t])
        S = S.mul_(decays[t]) if states is None else torch.mul(S, decays[t], out=states[t])
        S.baddbmm_(kcols[t], delta)
        torch.bmm(qs[t], S, out=o_t)
    o = o.view(T, H, V) if N == 1 else o.view(L, N, H, V).transpose(0, 1).reshape(T, H, V)
    if states is None:
        return o.to(v.dtype), S.view(N, H, K, V)
    return o.to(v.dtype), S.view(N, H, K, V), states.view(L, N, H, K, V)
