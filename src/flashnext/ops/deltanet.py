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
else runs the chunked kernel, a serving prefill in chunks of the power of two that holds its longest sequence
(`fitted_chunk`, 16 to `CHUNK`: a 32-token prompt is one 32-token chunk, its state taken without the scan).

On CUDA with flash-linear-attention installed (and `FLASHNEXT_FORCE_REF` unset) the FLA kernel is used instead;
it is imported lazily, never at model construction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashnext.batch import Segments
from flashnext.ops import rows
from flashnext.ops.deltanet_ref import prepare_qk
from flashnext.ops.deltanet_step import gated_delta_step, short_gated_delta_rule

CHUNK = 64
SHORT = 8  # sequences continuing a state with at most this many tokens: the per-position recurrence


# Traceable: it reads the host lengths (`seg.is_decode`, `seg.max_seqlen`) only when a state is given (serving), so
# a training graph, which passes none, never guards on them, and a compiled decode step traces the single-token
# kernel. The chunked kernel it calls otherwise is opaque to torch.compile itself.
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seg: Segments,
    initial_state: torch.Tensor | None = None,
    in_place: bool = False,
    positions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated delta rule over a flat stream, continuing from `initial_state` when given.

    Args:
        q, k: [T, H, K] raw (L2-normalised and q-scaled inside). v: [T, H, V]. g, beta: [T, H].
        seg: the stream's segments (N sequences).
        initial_state: optional fp32 [N, H, K, V], the state before each sequence (zeros when None).
        in_place: the final state may be written over `initial_state` (a decode step on a contiguous fp32 state
            that is not read afterwards, e.g. a slice of the serving cache).
        positions: also return the state after every position, fp32 [L, N, H, K, V] (L the longest sequence; a
            shorter one keeps its final state past its end): short sequences continuing states only (a verify
            step, `can_keep_positions`).

    Returns:
        o [T, H, V] in v's dtype and the final fp32 state [N, H, K, V] (and with `positions` the states).
    """
    if positions:
        if initial_state is None or not can_keep_positions(seg.lengths):
            raise ValueError(f"per-position states need sequences of 2 to {SHORT} tokens; got lengths {seg.lengths}")
        return short_gated_delta_rule(q, k, v, g, beta, seg, initial_state, positions=True)
    if initial_state is not None and seg.is_decode:
        return gated_delta_step(q, k, v, g, beta, initial_state, in_place=in_place)
    if initial_state is not None and seg.max_seqlen <= SHORT:
        return short_gated_delta_rule(q, k, v, g, beta, seg, initial_state)
    if initial_state is not None:  # serving: a short prompt pads to its own chunk size, not to CHUNK
        # A compiled static chunk step (`serve.chunk_graph.ChunkGraph`) traces the kernel: its layout is a
        # constant of the graph's shape there, so nothing specialises on a packing.
        run = _chunk_rule if torch.compiler.is_dynamo_compiling() else chunk_gated_delta_rule
        return run(q, k, v, g, beta, seg, initial_state, fitted_chunk(seg.max_seqlen))
    return chunk_gated_delta_rule(q, k, v, g, beta, seg, initial_state=initial_state)


def can_keep_positions(lengths: list[int]) -> bool:
    """Whether `gated_delta_rule` can return the state after every position of sequences of these lengths (the
    short path: not a decode step, none longer than `SHORT`)."""
    return 2 <= max(lengths) <= SHORT


def fitted_chunk(max_seqlen: int) -> int:
    """The chunk size for a stream whose longest sequence has `max_seqlen` tokens: the power of two >= it, between
    16 and `CHUNK`. A 32-token prompt then runs one 32-token chunk instead of one padded to 64 (the chunk's
    [C, C] terms and solve cost ~C^2: 1.5 -> 1.0 ms per GDN layer at 8 heads, fp32, 1 thread); the arithmetic
    is the same delta rule (only the split points, hence the rounding, differ: tested against the recurrence)."""
    return min(CHUNK, max(16, 1 << max(0, max_seqlen - 1).bit_length()))


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


def _use_fla(x: torch.Tensor) -> bool:
    if x.device.type != "cuda" or os.environ.get("FLASHNEXT_FORCE_REF"):
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def _chunk_rule(
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
        cu_seqlens: host list of N+1 cumulative lengths, or the stream's `Segments` (its `cu_host` is used, and
            the chunk layout is memoised on it for the other layers of the forward).
        initial_state: optional fp32 [N, H, K, V].

    Returns:
        o [T, H, V] in v's dtype and the final fp32 state [N, H, K, V].
    """
    if _use_fla(q):
        cu_host = cu_seqlens.cu_host if isinstance(cu_seqlens, Segments) else cu_seqlens
        return _fla_chunk(q, k, v, g, beta, cu_host, initial_state)
    layout = chunk_layout(cu_seqlens, chunk_size, v.device)
    out_dtype = v.dtype
    q, k = prepare_qk(q, k)
    v, g, beta = v.float(), g.float(), beta.float()
    T, H, K = k.shape
    V, NC, C = v.shape[-1], layout.num_chunks, chunk_size

    pad = NC * C != T  # else every slot holds a token, in order (`tok_slot` is the identity): no scatter/gather

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [NC, H, C, ...], padding slots zero
        x = rows.scatter_rows(x, layout.tok_slot, NC * C) if pad else x
        return x.reshape(NC, C, *x.shape[1:]).transpose(1, 2).contiguous()

    qc, kc, vc, gc, bc = (to_chunks(x) for x in (q, k, v, g, beta))
    A, B, M, U = _intra_chunk(qc, kc, vc, gc, bc)
    S0 = v.new_zeros(layout.num_seqs, H, K, V) if initial_state is None else initial_state.float()
    if NC == layout.num_seqs:  # one chunk per sequence (a short prefill): no scan, chunk n is sequence n
        return _single_chunks(A, B, M, U, S0, layout, out_dtype)
    S0 = rows.gather_rows(S0, layout.order)
    befores, final = _StateScan.apply(
        rows.gather_rows(M, layout.step_major), rows.gather_rows(U, layout.step_major), S0, layout.running
    )
    S = rows.gather_rows(befores, layout.chunk_major)  # state before each chunk, chunk order [NC, H, K, V]
    o_chunks = torch.baddbmm(B.flatten(0, 1), A.flatten(0, 1), S.flatten(0, 1)).view(NC, H, C, V)
    return _token_rows(o_chunks, layout).to(out_dtype), rows.gather_rows(final, layout.unorder)


# Opaque to torch.compile: the chunk layout and the scan's step count come from host lengths, so tracing would
# specialise a graph on every packing. A compiled caller passes the `Segments` (never its host list, which dynamo
# would guard on element by element) and this runs eagerly between graphs with its own autograd.
chunk_gated_delta_rule = torch.compiler.disable(_chunk_rule)


def _single_chunks(A, B, M, U, S0, layout: ChunkLayout, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule`'s tail when every sequence is one chunk: `o = A S0 + B`, `S' = M S0 + U` directly,
    the scan's one step (the same `baddbmm`) without its permutations, concatenations and autograd function (a
    dozen small host ops per GDN layer of a short prefill)."""
    NC, H, C, V = B.shape
    S0 = S0.flatten(0, 1)
    final = torch.baddbmm(U.flatten(0, 1), M.flatten(0, 1), S0).view(NC, H, *U.shape[2:])
    o_chunks = torch.baddbmm(B.flatten(0, 1), A.flatten(0, 1), S0).view(NC, H, C, V)
    return _token_rows(o_chunks, layout).to(out_dtype), final


def _token_rows(o_chunks: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """Chunk outputs [NC, H, C, V] -> token rows [T, H, V]: gathered from their slots, unless every slot is a
    token (no padding: a prompt that fills its chunks, e.g. 32 tokens at the fitted chunk size 32)."""
    NC, H, C, V = o_chunks.shape
    flat = o_chunks.transpose(1, 2).reshape(NC * C, H, V)
    return flat if NC * C == layout.tok_slot.numel() else rows.gather_rows(flat, layout.tok_slot)


@dataclass
class ChunkLayout:
    """Where each token and chunk of a stream goes (host math from the lengths; device index tensors).

    Attributes:
        cu_host: the N+1 cumulative lengths.
        num_seqs, num_chunks: N and NC (each sequence cut into ceil(n / C) chunks, the last one padded).
        tok_slot: int64 [T], the chunk slot (chunk * C + offset) of every token.
        order / unorder: int64 [N], sequences by descending chunk count, and its inverse.
        running: host list, per scan step j, the sequences (a prefix of `order`) that have a j-th chunk.
        step_major / chunk_major: int64 [NC], chunks in scan order (step by step, `order` within a step) and the
            inverse permutation.
    """

    cu_host: list[int]
    num_seqs: int
    num_chunks: int
    tok_slot: torch.Tensor
    order: torch.Tensor
    unorder: torch.Tensor
    running: list[int]
    step_major: torch.Tensor
    chunk_major: torch.Tensor


def chunk_layout(cu_seqlens: list[int] | Segments, chunk_size: int, device: torch.device) -> ChunkLayout:
    """The `ChunkLayout` of a stream (memoised on a `Segments`: every GDN layer of a forward shares it)."""
    if isinstance(cu_seqlens, Segments):
        key = ("gdn_chunks", chunk_size)
        if key not in cu_seqlens.memo:
            cu_seqlens.memo[key] = _build_layout(cu_seqlens.cu_host, chunk_size, device)
        return cu_seqlens.memo[key]
    return _build_layout(list(cu_seqlens), chunk_size, device)


def _build_layout(cu: list[int], C: int, device: torch.device) -> ChunkLayout:
    N = len(cu) - 1
    lengths = [cu[i + 1] - cu[i] for i in range(N)]
    nchunks = [-(-n // C) for n in lengths]
    first = [0]
    for n in nchunks:
        first.append(first[-1] + n)
    tok_slot = [first[i] * C + j for i in range(N) for j in range(lengths[i])]
    order = sorted(range(N), key=lambda n: -nchunks[n])  # stable: longest first, so running ones are a prefix
    steps = nchunks[order[0]] if N else 0
    running = [sum(1 for n in order if nchunks[n] > j) for j in range(steps)]
    step_major = [first[order[r]] + j for j in range(steps) for r in range(running[j])]
    unorder, chunk_major = [0] * N, [0] * len(step_major)
    for i, n in enumerate(order):
        unorder[n] = i
    for i, c in enumerate(step_major):
        chunk_major[c] = i

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long).to(device)

    return ChunkLayout(
        list(cu), N, first[-1], t(tok_slot), t(order), t(unorder), running, t(step_major), t(chunk_major)
    )


def _intra_chunk(q, k, v, g, beta):
    """Per-chunk terms of the UT transform, rearranged so the scan only carries the state.

    Shapes: q, k [NC, H, C, K], v [NC, H, C, V], g, beta [NC, H, C]. Within a chunk (WY form of its C delta
    updates): `new_v = T^-1 (beta v)`, `w = T^-1 (beta k exp(cum))` with T the unit lower-triangular system, and
    with S the state before the chunk, `o = q_dec S + intra (new_v - w S)`, `S' = decay S + k_dec^T (new_v - w S)`.
    Collecting the S terms gives `o = A S + B` and `S' = M S + U`, all four batched over every chunk here, so the
    sequential scan is one [K, K] x [K, V] product per step.

    Returns:
        A [NC, H, C, K], B [NC, H, C, V], M [NC, H, K, K], U [NC, H, K, V].
    """
    C, K = q.shape[2], q.shape[3]
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(-1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # (I + strictly-lower(k_beta k^T * decay)) is the unit lower-triangular system of the chunk's delta updates;
    # one solve (batched matmuls, see `solve_unit_lower`) for both right-hand sides.
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    new_v, w = solve_unit_lower((k_beta @ k.transpose(-1, -2)) * decay, rhs).split([v.shape[-1], K], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    k_dec = (k * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2)  # [NC, H, K, C]
    A = torch.baddbmm((q * cum.exp().unsqueeze(-1)).flatten(0, 1), intra.flatten(0, 1), w.flatten(0, 1), alpha=-1)
    B = intra @ new_v
    eye = torch.eye(K, dtype=q.dtype, device=q.device) * cum[..., -1:, None].exp()  # [NC, H, K, K]
    M = torch.baddbmm(eye.flatten(0, 1), k_dec.flatten(0, 1), w.flatten(0, 1), alpha=-1)
    U = k_dec @ new_v
    return A.view_as(q), B, M.view_as(eye), U


class _StateScan(torch.autograd.Function):
    """`S_{j+1} = M_j S_j + U_j` across chunks, one batched `baddbmm` per step in forward and in backward.

    Inputs are in step-major order (step j holds `running[j]` chunks, one per sequence still running, a prefix of
    the sequences sorted by chunk count): M [NC, H, K, K], U [NC, H, K, V], S0 [N, H, K, V] (sorted order).
    Returns the state before every chunk [NC, H, K, V] (step-major) and each sequence's final state [N, H, K, V].
    The backward runs the adjoint recurrence `G_j = M_j^T G_{j+1} + dS_j`, then every dM as one batched product.
    """

    @staticmethod
    def forward(ctx, M, U, S0, running):
        S, befores, done, off = S0, [], [], 0
        for r in running:
            if r < S.shape[0]:  # sequences without a chunk at this step are final
                done.append(S[r:])
                S = S[:r]
            befores.append(S)
            S = torch.baddbmm(U[off : off + r].flatten(0, 1), M[off : off + r].flatten(0, 1), S.flatten(0, 1))
            S = S.view(r, *S0.shape[1:])
            off += r
        done.append(S)
        final = torch.cat(done[::-1])
        before = torch.cat(befores) if befores else S0.new_zeros(0, *S0.shape[1:])
        ctx.save_for_backward(M, before)
        ctx.running = running
        return before, final

    @staticmethod
    def backward(ctx, d_before, d_final):
        M, before = ctx.saved_tensors
        running = ctx.running
        N = d_final.shape[0]
        ends = [0] * len(running)
        off = 0
        for j, r in enumerate(running):
            off += r
            ends[j] = off
        g = d_final[: running[-1]] if running else d_final[:0]
        d_after = [None] * len(running)
        for j in range(len(running) - 1, -1, -1):
            r = running[j]
            if g.shape[0] < r:  # sequences whose last chunk is step j: their final state's gradient
                g = torch.cat([g, d_final[g.shape[0] : r]])
            d_after[j] = g
            lo = ends[j] - r
            g = torch.baddbmm(
                d_before[lo : ends[j]].flatten(0, 1), M[lo : ends[j]].flatten(0, 1).transpose(1, 2), g.flatten(0, 1)
            ).view(r, *g.shape[1:])
        d_S0 = torch.cat([g, d_final[g.shape[0] : N]])
        if not running:
            return M.new_zeros(M.shape), M.new_zeros(0, *d_final.shape[1:]), d_S0, None
        d_U = torch.cat(d_after)
        d_M = torch.bmm(d_U.flatten(0, 1), before.flatten(0, 1).transpose(1, 2)).view(M.shape)
        return d_M, d_U, d_S0, None


class _UnitLowerSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lower, rhs):
        inv = _invert_unit_lower(lower)
        out = inv @ rhs
        ctx.save_for_backward(inv, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        inv, out = ctx.saved_tensors
        # x = T^-1 b: db = T^-T dx, and dT = -db x^T, of which only the strictly lower part is an input.
        d_rhs = inv.transpose(-1, -2) @ grad
        return (d_rhs @ out.transpose(-1, -2)).neg_().tril_(-1), d_rhs


def solve_unit_lower(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """x = (I + strictly_lower(lower))^-1 rhs for a batch: lower [..., C, C] (diagonal and upper part ignored),
    rhs [..., C, R].

    The inverse is built by forward substitution inside 16 x 16 diagonal blocks (16 batched row steps), then the
    blocks are merged pairwise, `[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]`, up to C: a handful
    of batched matmuls over every chunk at once, where `torch.linalg.solve_triangular` on CPU solves the systems
    one by one (a quarter of the 2-thread fwd+bwd step at 4096 tokens in the profile). The backward is two
    batched matmuls. Twin: `torch.linalg.solve_triangular(..., unitriangular=True)` (tested), which is also what
    runs for inference (no grad) on CPU with few systems (`LAPACK_SOLVES`): one short prefill's chunks.
    """
    if lower.device.type == "cpu" and lower[..., 0, 0].numel() <= LAPACK_SOLVES and not _needs_grad(lower, rhs):
        # as X^T = R^T L^-T: the transposed views are the column-major layout LAPACK reads, so neither side is
        # copied first (8 systems of 32 with 64 right-hand sides: 36 against 86 us in the `lower, rhs` form)
        return torch.linalg.solve_triangular(lower.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    return _UnitLowerSolve.apply(lower, rhs)


# Inference on CPU with at most this many systems (a prefill of up to 512 tokens at 8 heads, one chunk each of 8):
# LAPACK's unit-triangular solve, which reads only the strictly lower part too. Measured, fp32, 1 thread, C = 32:
# 8 systems 0.04 ms against 0.34 ms for the batched inverse's 15 row steps and merge; C = 64: 0.18 against 0.49 ms
# (in the copying `lower, rhs` form).
LAPACK_SOLVES = 64


def _needs_grad(*xs: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def _invert_unit_lower(L: torch.Tensor) -> torch.Tensor:
    """Inverse of I + strictly_lower(L), L [..., C, C]; reads only the strictly lower part (no autograd)."""
    C = L.shape[-1]
    batch = L.shape[:-2]
    P = 1 << max(0, (C - 1).bit_length())  # padded to a power of two: block-diagonal with I, same inverse
    if P != C:
        L = torch.nn.functional.pad(L, (0, P - C, 0, P - C))
    L = L.reshape(-1, P, P)
    b = min(16, P)
    n = P // b
    diag = _diagonal_blocks(L, b)  # [Bt, n, b, b]
    X = torch.eye(b, dtype=L.dtype, device=L.device).repeat(*diag.shape[:2], 1, 1)
    for i in range(1, b):  # row i of the inverse: -L[i, :i] X[:i, :i] (unit diagonal)
        X[..., i, :i] = -(diag[..., i : i + 1, :i] @ X[..., :i, :i]).squeeze(-2)
    while b < P:
        pairs = _diagonal_blocks(L, 2 * b)[..., b:, :b]  # lower-left b x b block of each 2b-block
        a_inv, d_inv = X[:, 0::2], X[:, 1::2]
        merged = X.new_zeros(X.shape[0], n // 2, 2 * b, 2 * b)
        merged[..., :b, :b] = a_inv
        merged[..., b:, b:] = d_inv
        merged[..., b:, :b] = -(d_inv @ pairs @ a_inv)
        X, b, n = merged, 2 * b, n // 2
    return X.view(*batch, P, P)[..., :C, :C]


def _diagonal_blocks(L: torch.Tensor, b: int) -> torch.Tensor:
    """The b x b diagonal blocks of L [Bt, P, P] -> [Bt, P // b, b, b]."""
    n = L.shape[-1] // b
    return torch.diagonal(L.view(-1, n, b, n, b), dim1=1, dim2=3).permute(0, 3, 1, 2)


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
