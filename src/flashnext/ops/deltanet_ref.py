"""Gated delta rule, token by token: the readable spec of `ops.deltanet` (and the decode path).

Legend: T tokens, N sequences, H value heads, K key dim, V value dim. Inputs are already expanded to H heads.
State S: [N, H, K, V]. Per token: S <- S * exp(g); S <- S + k (beta * (v - S^T k))^T; o = S^T q.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, L2-normalised q and k, with q scaled by K^-0.5 (as FLA's `use_qk_l2norm_in_kernel`)."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential gated delta rule over a flat stream of sequences.

    Args:
        q, k: [T, H, K] raw (this function L2-normalises and scales them).
        v: [T, H, V].
        g: [T, H] log-decay (<= 0). beta: [T, H] write strength in (0, 1).
        cu_seqlens: host list of N+1 cumulative lengths.
        initial_state: optional fp32 [N, H, K, V].

    Returns:
        o [T, H, V] in v's dtype, final state fp32 [N, H, K, V].
    """
    out_dtype = v.dtype
    q, k = prepare_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    N = len(cu_seqlens) - 1
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    outs = []
    finals = []
    for n in range(N):
        a, b = cu_seqlens[n], cu_seqlens[n + 1]
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].float()
        for t in range(a, b):
            S = S * g[t].exp()[:, None, None]
            pred = (S * k[t][:, :, None]).sum(1)
            delta = (v[t] - pred) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            outs.append((S * q[t][:, :, None]).sum(1))
        finals.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, H, V)
    final = torch.stack(finals) if finals else v.new_zeros(0, H, K, V)
    return o.to(out_dtype), final
