"""Chunked gated delta rule over a flat stream of sequences (training and prefill).

Legend: T tokens, N sequences, H value heads, K key dim, V value dim, C chunk size, NC chunks.
Each sequence is cut into C-token chunks (its last chunk zero-padded: zero k/v/beta and zero log-decay leave the
state untouched). Within a chunk the delta-rule updates are condensed with the UT transform (a unit lower-triangular
solve); across chunks a scan carries the [H, K, V] state, batched over the sequences still running at that step.
`ops.deltanet_ref.recurrent_gated_delta_rule` is the token-by-token spec this must equal.

`gated_delta_rule` is the entry point the model calls: it takes an optional per-sequence `initial_state` and returns
the final state, and picks the kernel by shape itself: one token per sequence with a state (a serving decode step)
runs the batched single-token recurrence of `ops.deltanet_step`; sequences of at most `SHORT` tokens with a state
(a speculative verify step: the last token and a few drafts) run that recurrence once per position
(`short_gated_delta_rule`), which costs a few small ops per token where a chunk pads to `CHUNK` tokens; anything
else runs the chunked kernel.

On CUDA with flash-linear-attention installed (and `FLASHNEXT_FORCE_REF` unset) the FLA kernel is used instead;
it is imported lazily, never at model construction.
"""

from __future__ import annotations

import os

import torch

from flashnext.batch import Segments
from flashnext.ops.deltanet_ref import prepare_qk
from flashnext.ops.deltanet_step import gated_delta_step

CHUNK = 64
SHORT = 8  # sequences continuing a state with at most this many tokens: the per-position recurrence


@torch.compiler.disable  # reads host lengths to choose (see chunk_gated_delta_rule)
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seg: Segments,
    initial_state: torch.Tensor | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a flat stream, continuing from `initial_state` when given.

    Args:
        q, k: [T, H, K] raw (L2-normalised and q-scaled inside). v: [T, H, V]. g, beta: [T, H].
        seg: the stream's segments (N sequences).
        initial_state: optional fp32 [N, H, K, V], the state before each sequence (zeros when None).
        in_place: the final state may be written over `initial_state` (a decode step on a contiguous fp32 state
            that is not read afterwards, e.g. a slice of the serving cache).

    Returns:
        o [T, H, V] in v's dtype and the final fp32 state [N, H, K, V].
    """
    if initial_state is not None and seg.is_decode:
        return gated_delta_step(q, k, v, g, beta, initial_state, in_place=in_place)
    if initial_state is not None and seg.max_seqlen <= SHORT:
        return short_gated_delta_rule(q, k, v, g, beta, seg, initial_state)
    return chunk_gated_delta_rule(q, k, v, g, beta, seg, initial_state=initial_state)


def gated_delta_rule_affine(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seg: Segments,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule as an affine function of the FIRST sequence's unknown initial state S0.

    The recurrence is linear in (state, v): every output row of the first sequence is `o0 + resp @ S0` and its
    final state is `A @ S0 + U`. All four come from one pass of `gated_delta_rule` with K extra value channels:
    v extended by zeros and the first sequence's initial state `[0 | I_K]`, so the extra channels carry the
    response to an identity state. Context parallelism uses it: a rank whose first sequence continues from the
    previous rank computes everything before it knows S0, and the ranks then compose their (A, U) pairs.

    Args:
        q, k: [T, H, K] raw; v: [T, H, V]; g, beta: [T, H]; seg: the stream's segments (N >= 1 sequences).

    Returns:
        o0 [T, H, V] (every sequence from a zero state), resp [T, H, K] (zero outside the first sequence),
        A fp32 [H, K, K] and U fp32 [H, K, V] of the LAST sequence: its final state is `A @ S0 + U` (A is zero
        unless the stream holds one sequence, since later sequences start fresh).
    """
    T, H, K = k.shape
    V = v.shape[-1]
    N = len(seg.lengths)
    v_aug = torch.cat([v, v.new_zeros(T, H, K)], dim=-1)
    initial = torch.zeros(N, H, K, V + K, dtype=torch.float32, device=v.device)
    initial[0, :, :, V:] = torch.eye(K, device=v.device)
    o, final = gated_delta_rule(q, k, v_aug, g, beta, seg, initial_state=initial)
    return o[..., :V], o[..., V:], final[-1, ..., V:], final[-1, ..., :V]


def short_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seg: Segments,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Short sequences continuing states: `gated_delta_step` at each position t, over the sequences longer than t.

    Args/returns as `gated_delta_rule` (`initial_state` required, not modified).
    """
    starts, lengths = seg.cu_host[:-1], seg.lengths
    S = initial_state.float().clone()
    o = v.new_empty(v.shape)
    everyone = torch.arange(len(lengths), device=v.device)
    for t in range(seg.max_seqlen):
        live = [n for n, length in enumerate(lengths) if length > t]
        rows = torch.tensor([starts[n] + t for n in live], dtype=torch.long, device=v.device)
        idx = everyone if len(live) == len(lengths) else torch.tensor(live, dtype=torch.long, device=v.device)
        pick = [x.index_select(0, rows) for x in (q, k, v, g, beta)]
        o_t, s_t = gated_delta_step(*pick, S.index_select(0, idx))
        o.index_copy_(0, rows, o_t)
        S.index_copy_(0, idx, s_t)
    return o, S


def _use_fla(x: torch.Tensor) -> bool:
    if x.device.type != "cuda" or os.environ.get("FLASHNEXT_FORCE_REF"):
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


# Opaque to torch.compile: the chunk layout and the scan's step count come from host lengths, so tracing would
# specialise a graph on every packing. A compiled caller passes the `Segments` (never its host list, which dynamo
# would guard on element by element) and this runs eagerly between graphs with its own autograd.
@torch.compiler.disable
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int] | Segments,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule for every sequence of a flat stream. Same contract as `recurrent_gated_delta_rule`.

    Args:
        q, k: [T, H, K] raw (L2-normalised and q-scaled here). v: [T, H, V]. g, beta: [T, H].
        cu_seqlens: host list of N+1 cumulative lengths, or the stream's `Segments` (its `cu_host` is used).
        initial_state: optional fp32 [N, H, K, V].

    Returns:
        o [T, H, V] in v's dtype and the final fp32 state [N, H, K, V].
    """
    if isinstance(cu_seqlens, Segments):
        cu_seqlens = cu_seqlens.cu_host
    if _use_fla(q):
        return _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state)
    out_dtype = v.dtype
    q, k = prepare_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    T, H, K = k.shape
    V = v.shape[-1]
    N = len(cu_seqlens) - 1
    device = v.device
    C = chunk_size
    lengths = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(N)]
    nchunks = [-(-n // C) for n in lengths]
    NC = sum(nchunks)

    # Slot layout: chunk-aligned copy of the stream; slot -> token (T = the zero row) and token -> slot.
    # Built on the host from the lengths (no device sync; works on the meta device).
    cu_t = torch.tensor(cu_seqlens, dtype=torch.long)
    chunk_seq = torch.repeat_interleave(torch.arange(N), torch.tensor(nchunks), output_size=NC)
    first_chunk = torch.tensor([0] + nchunks).cumsum(0)[:-1]
    chunk_j = torch.arange(NC) - first_chunk[chunk_seq]
    slot_tok = (cu_t[chunk_seq] + chunk_j * C)[:, None] + torch.arange(C)
    valid = (slot_tok < cu_t[chunk_seq + 1][:, None]).flatten()
    src = torch.where(valid, slot_tok.flatten(), T).to(device)
    tok_slot = valid.nonzero().flatten().to(device)

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [NC, H, C, ...]
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])]).index_select(0, src)
        x = x.view(NC, C, *x.shape[1:])
        return x.transpose(1, 2).contiguous()

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    gc, bc = to_chunks(g), to_chunks(beta)  # [NC, H, C]

    intra, new_v, k_cumdecay, q_dec, k_dec, chunk_decay = _intra_chunk(qc, kc, vc, gc, bc)
    o_chunks, final = _scan(intra, new_v, k_cumdecay, q_dec, k_dec, chunk_decay, nchunks, initial_state, H, K, V)
    o = o_chunks.transpose(1, 2).reshape(NC * C, H, V).index_select(0, tok_slot)
    return o.to(out_dtype), final


def _intra_chunk(q, k, v, g, beta):
    """Per-chunk quantities of the UT transform. Shapes: q, k [NC, H, C, K], v [NC, H, C, V], g, beta [NC, H, C]."""
    C = q.shape[2]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    # (I + strictly-lower(k_beta k^T * decay)) is the unit lower-triangular system of the chunk's delta updates.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    # One solve for both right-hand sides.
    rhs = torch.cat([v_beta, k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_v, k_cumdecay = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()
    return intra, new_v, k_cumdecay, q_dec, k_dec, chunk_decay


def _scan(intra, new_v, k_cumdecay, q_dec, k_dec, chunk_decay, nchunks, initial_state, H, K, V):
    """Carry the state across chunks; step j runs the j-th chunk of every sequence that has one.

    Chunks are permuted once into step-major order (longest sequences first, so the sequences still running at
    step j are a prefix) and `split` into per-step views: autograd then joins the per-step gradients with one
    `cat`, instead of a full-size scatter per step (which made long sequences quadratic).
    """
    N = len(nchunks)
    device = new_v.device
    order = sorted(range(N), key=lambda n: -nchunks[n])
    first = [sum(nchunks[:n]) for n in range(N)]
    steps = nchunks[order[0]] if N else 0
    running = [sum(1 for n in order if nchunks[n] > j) for j in range(steps)]
    perm = [first[order[r]] + j for j in range(steps) for r in range(running[j])]
    perm_t = torch.tensor(perm, dtype=torch.long, device=device)
    pieces = [x.index_select(0, perm_t).split(running) for x in (intra, new_v, k_cumdecay, q_dec, k_dec, chunk_decay)]
    if initial_state is None:
        S = new_v.new_zeros(N, H, K, V)
    else:
        S = initial_state.float().index_select(0, torch.tensor(order, dtype=torch.long, device=device))
    finals: list = [None] * N
    outs = []
    active = N
    for j in range(steps):
        for r in range(running[j], active):  # sequences that finished before step j
            finals[order[r]] = S[r]
        active = running[j]
        S = S[:active]
        a_intra, a_new_v, a_kcd, a_qdec, a_kdec, a_decay = (p[j] for p in pieces)
        v_new = a_new_v - a_kcd @ S
        outs.append(a_qdec @ S + a_intra @ v_new)
        S = S * a_decay[..., None, None] + a_kdec.transpose(-1, -2) @ v_new
    for r in range(active):
        finals[order[r]] = S[r]
    final = torch.stack(finals) if N else new_v.new_zeros(0, H, K, V)
    if not outs:
        return new_v.new_zeros(0, H, new_v.shape[2], V), final
    inverse = torch.empty_like(perm_t)
    inverse[perm_t] = torch.arange(len(perm), device=device)
    return torch.cat(outs).index_select(0, inverse), final


def _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    cu = torch.tensor(cu_seqlens, dtype=torch.long, device=q.device)
    o, final = fla_chunk(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )
    return o.squeeze(0), final
