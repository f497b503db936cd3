"""Chunked varlen gated delta rule == the token-by-token recurrence, forward, final state and backward."""

import pytest
import torch

from flashnext.ops.deltanet import chunk_gated_delta_rule
from flashnext.ops.deltanet_ref import recurrent_gated_delta_rule


def _inputs(cu, H=3, K=8, V=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = cu[-1]
    q = torch.randn(T, H, K, generator=g, dtype=dtype)
    k = torch.randn(T, H, K, generator=g, dtype=dtype)
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    decay = -torch.rand(T, H, generator=g, dtype=dtype) * 2
    beta = torch.rand(T, H, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize(
    "cu",
    [[0, 1], [0, 64], [0, 130], [0, 5, 5, 75, 205, 206], [0, 0, 3], [0, 63, 64, 200]],
    ids=["len1", "one-chunk", "three-chunks", "mixed-with-empty", "leading-empty", "boundaries"],
)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
def test_chunked_matches_recurrent(cu, with_state):
    inputs = _inputs(cu)
    N = len(cu) - 1
    init = torch.randn(N, 3, 8, 6, dtype=torch.float64) if with_state else None
    o1, f1 = chunk_gated_delta_rule(*inputs, cu, init, chunk_size=16)
    o2, f2 = recurrent_gated_delta_rule(*inputs, cu, init)
    assert o1.shape == o2.shape == (cu[-1], 3, 6)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(f1, f2, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(o1)
    g1 = torch.autograd.grad((o1 * w).sum() + f1.sum(), inputs)
    g2 = torch.autograd.grad((o2 * w).sum() + f2.sum(), inputs)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sequences_are_independent():
    """A packed stream equals each sequence alone: the state resets at every boundary."""
    cu = [0, 37, 100, 101]
    inputs = [t.detach() for t in _inputs(cu)]
    o_all, f_all = chunk_gated_delta_rule(*inputs, cu)
    for n in range(3):
        a, b = cu[n], cu[n + 1]
        o_one, f_one = chunk_gated_delta_rule(*[t[a:b] for t in inputs], [0, b - a])
        torch.testing.assert_close(o_all[a:b], o_one, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(f_all[n], f_one[0], rtol=1e-6, atol=1e-6)


def test_prefill_then_continue_equals_whole():
    """Chunked prefill: running [0, a) then [a, T) from the carried state equals one pass (serving relies on it)."""
    cu = [0, 90]
    inputs = [t.detach() for t in _inputs(cu)]
    o_all, f_all = chunk_gated_delta_rule(*inputs, cu)
    a = 41
    o1, f1 = chunk_gated_delta_rule(*[t[:a] for t in inputs], [0, a])
    o2, f2 = recurrent_gated_delta_rule(*[t[a:] for t in inputs], [0, 90 - a], f1)
    torch.testing.assert_close(torch.cat([o1, o2]), o_all, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(f2, f_all, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize("in_place", [False, True], ids=["new-state", "in-place"])
def test_decode_step_matches_recurrent(in_place, traced):
    """`gated_delta_step` over N sequences, one token at a time, == the recurrence (outputs and final states);
    traced by dynamo (as in the compiled decode step: its broadcast-sum form, no bmm) too."""
    from flashnext.ops.deltanet_step import gated_delta_step

    if traced:
        ops = set()

        def backend(gm, example_inputs):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        torch._dynamo.reset()
        gated_delta_step = torch.compile(gated_delta_step, backend=backend, fullgraph=True, dynamic=False)

    N, L = 3, 5
    q, k, v, decay, beta = (t.detach() for t in _inputs([0, N * L]))
    init = torch.randn(N, 3, 8, 6, generator=torch.Generator().manual_seed(1))
    cu = [i * L for i in range(N + 1)]
    ref_o, ref_state = recurrent_gated_delta_rule(q, k, v, decay, beta, cu, initial_state=init)
    state = init.clone()
    outs = []
    for t in range(L):
        rows = torch.arange(N) * L + t  # token t of every sequence
        o, new = gated_delta_step(q[rows], k[rows], v[rows], decay[rows], beta[rows], state, in_place=in_place)
        assert (new.data_ptr() == state.data_ptr()) == in_place
        state = new
        outs.append(o)
    got_o = torch.stack(outs, 1).reshape(N * L, *outs[0].shape[1:])
    torch.testing.assert_close(got_o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)
    if traced:
        assert ops and not any("bmm" in op for op in ops), ops


@pytest.mark.parametrize(
    "cu",
    [[0, 1, 2, 3], [0, 1, 1, 2], [0, 4, 9], [0, 3, 3, 11, 12], [0, 4, 30]],
    ids=["decode", "decode-with-empty", "short", "short-mixed-with-empty", "chunked"],
)
def test_dispatcher_picks_a_kernel_that_matches_recurrent(cu):
    """`gated_delta_rule` (the model's entry point) continues from a state whichever kernel its shape selects."""
    from flashnext.batch import make_segments
    from flashnext.ops.deltanet import gated_delta_rule

    inputs = [t.detach() for t in _inputs(cu)]
    N = len(cu) - 1
    init = torch.randn(N, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seg = make_segments(torch.tensor(cu, dtype=torch.int32), cu[-1])
    before = init.clone()
    o, final = gated_delta_rule(*inputs, seg, initial_state=init)
    assert torch.equal(init, before)  # the states are read, not overwritten
    ref_o, ref_final = recurrent_gated_delta_rule(*inputs, cu, init)
    torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("C", [1, 3, 16, 20, 64], ids=lambda c: f"C{c}")
def test_unit_lower_solve_matches_solve_triangular(C):
    """The chunk's batched-matmul solve == LAPACK's unit-triangular solve, forward and backward (fp64)."""
    from flashnext.ops.deltanet import solve_unit_lower

    g = torch.Generator().manual_seed(C)
    lower = (torch.randn(4, 3, C, C, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    rhs = torch.randn(4, 3, C, 5, generator=g, dtype=torch.float64, requires_grad=True)
    x = solve_unit_lower(lower, rhs)  # reads only the strictly lower part of `lower`
    system = torch.eye(C, dtype=torch.float64) + lower.tril(-1)
    ref = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(x.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((x * w).sum(), (lower, rhs))
    want = torch.autograd.grad((ref * w).sum(), (lower, rhs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cu", [[0, 90], [0, 41, 45, 120]], ids=["one-sequence", "three-sequences"])
def test_affine_form_equals_a_pass_from_the_first_sequences_state(cu):
    """`gated_delta_rule_affine` (context parallelism): `o0 + resp @ S0` and `A @ S0 + U` equal a pass whose first
    sequence starts from S0; A is zero when the last sequence is not the first (it starts fresh)."""
    from flashnext.batch import make_segments
    from flashnext.ops.deltanet import gated_delta_rule, gated_delta_rule_affine

    inputs = [t.detach().float() for t in _inputs(cu)]
    seg = make_segments(torch.tensor(cu, dtype=torch.int32), cu[-1])
    N = len(cu) - 1
    s0 = torch.randn(3, 8, 6, generator=torch.Generator().manual_seed(3))
    initial = torch.zeros(N, 3, 8, 6)
    initial[0] = s0
    o, final = gated_delta_rule(*inputs, seg, initial_state=initial)
    o0, resp, A, U = gated_delta_rule_affine(*inputs, seg)
    assert not resp[cu[1] :].any()  # only the first sequence responds to S0
    torch.testing.assert_close(o0 + torch.einsum("thk,hkv->thv", resp, s0), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(A @ s0 + U, final[-1], rtol=1e-5, atol=1e-5)
    assert (not A.any()) == (N > 1)


@pytest.mark.parametrize("cu", [[0, 4], [0, 5, 10, 15]], ids=["one-verify", "equal-verifies"])
def test_equal_short_sequences_take_the_strided_path(cu, monkeypatch):
    """Short sequences of one length (a speculative verify step: each request's last token and as many drafts) run
    `deltanet_step.equal_short_gated_delta_rule` (preparation once, strided positions, the state stepped in place)
    and match the recurrence; the state passed in is not modified. fp64 inputs, fp32 arithmetic inside: 1e-6."""
    from flashnext.batch import make_segments
    from flashnext.ops import deltanet, deltanet_step

    calls = []
    fast = deltanet_step.equal_short_gated_delta_rule
    monkeypatch.setattr(deltanet_step, "equal_short_gated_delta_rule", lambda *a: calls.append(1) or fast(*a))
    inputs = [t.detach() for t in _inputs(cu)]
    init = torch.randn(len(cu) - 1, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    before = init.clone()
    o, final = deltanet.gated_delta_rule(*inputs, make_segments(torch.tensor(cu, dtype=torch.int32), cu[-1]), init)
    assert calls == [1] and torch.equal(init, before)
    ref_o, ref_final = recurrent_gated_delta_rule(*inputs, cu, init)
    torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("N, L", [(1, 2), (1, 4), (3, 2), (4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equal_short_sequences_step_as_the_decode_step_does(N, L, dtype):
    """The strided verify path equals the decode step (`gated_delta_step`) run position by position, bit for bit:
    the same products on the same shapes and the same elementwise steps in the same order, so a verify step's
    logits are the ones plain decode steps would give (its layout: none at N = 1, one position-major copy else),
    and the states it keeps per position (`positions`) are the decode step's after each; the input state is kept."""
    from flashnext.ops import deltanet_step
    from flashnext.ops.deltanet_step import gated_delta_step

    cu = [i * L for i in range(N + 1)]
    q, k, v, g, beta = [
        t.detach().to(dtype) if i != 3 else t.detach().float() for i, t in enumerate(_inputs(cu, 4, 16, 8))
    ]
    init = torch.randn(N, 4, 16, 8, generator=torch.Generator().manual_seed(5))
    before = init.clone()
    o, final = deltanet_step.equal_short_gated_delta_rule(q, k, v, g, beta, init)
    o2, final2, states = deltanet_step.equal_short_gated_delta_rule(q, k, v, g, beta, init, positions=True)
    S, rows = init, []
    for t in range(L):
        at = [n * L + t for n in range(N)]
        o_t, S = gated_delta_step(q[at], k[at], v[at], g[at], beta[at], S)
        rows.append(o_t)
        assert torch.equal(states[t], S)  # the state after position t, kept for a verify step
    want = torch.stack(rows, 1).reshape(N * L, 4, 8)
    assert o.dtype == dtype and torch.equal(o, want) and torch.equal(final, S)
    assert torch.equal(o2, want) and torch.equal(final2, S) and torch.equal(init, before)


def test_short_sequences_of_several_lengths_keep_the_state_after_each_position():
    """A verify step of entries of unequal lengths (drafts of several lengths, an entry without drafts) keeps, per
    position t, every sequence's state after t (its final state once it has ended): the decode step's, run one
    sequence at a time, bit for bit (the batched step's products and elementwise steps are per row)."""
    from flashnext.batch import make_segments
    from flashnext.ops import deltanet
    from flashnext.ops.deltanet_step import gated_delta_step

    cu = [0, 3, 4, 8, 10]
    q, k, v, g, beta = [t.detach().float() for t in _inputs(cu, 4, 16, 8)]
    init = torch.randn(4, 4, 16, 8, generator=torch.Generator().manual_seed(6))
    seg = make_segments(torch.tensor(cu, dtype=torch.int32), cu[-1])
    o, final, states = deltanet.gated_delta_rule(q, k, v, g, beta, seg, init, positions=True)
    assert states.shape == (4, 4, 4, 16, 8)
    for n in range(4):
        S = init[n : n + 1]
        for t in range(4):
            if cu[n] + t < cu[n + 1]:
                at = [cu[n] + t]
                o_t, S = gated_delta_step(q[at], k[at], v[at], g[at], beta[at], S)
                assert torch.equal(o[at], o_t)
            assert torch.equal(states[t, n], S[0])
        assert torch.equal(final[n], S[0])
    with pytest.raises(ValueError, match="lengths"):
        deltanet.gated_delta_rule(q, k, v, g, beta, make_segments(torch.tensor([0, 10]), 10), init[:1], positions=True)


@pytest.mark.parametrize("C", [16, 20, 64], ids=lambda c: f"C{c}")
def test_inference_solve_takes_lapack_and_equals_the_batched_inverse(C, monkeypatch):
    """Without grad on CPU, a few systems (one short prefill's chunks) are solved by LAPACK's unit-triangular
    solve, not the batched inverse (made to fail here); it reads only the strictly lower part as the batched
    inverse does (the diagonal and upper part hold noise) and equals it (fp64: 1e-10)."""
    from flashnext.ops import deltanet

    g = torch.Generator().manual_seed(C)
    lower = torch.randn(2, 4, C, C, generator=g, dtype=torch.float64) * 0.3
    rhs = torch.randn(2, 4, C, 7, generator=g, dtype=torch.float64)
    batched = deltanet._UnitLowerSolve.apply(lower, rhs)

    def refuse(L):
        raise AssertionError("the batched inverse ran for an inference solve")

    monkeypatch.setattr(deltanet, "_invert_unit_lower", refuse)
    with torch.inference_mode():
        torch.testing.assert_close(deltanet.solve_unit_lower(lower, rhs), batched, rtol=1e-10, atol=1e-10)
    with pytest.raises(AssertionError, match="batched inverse"):  # with grad: the batched inverse and its backward
        deltanet.solve_unit_lower(lower.requires_grad_(), rhs)


@pytest.mark.parametrize("cu", [[0, 32], [0, 9, 41], [0, 17, 30, 60]], ids=["one-32", "two", "three"])
def test_serving_prefill_pads_to_its_own_chunk_size(cu):
    """A serving prefill (a state given) whose sequences are shorter than `CHUNK` runs chunks of the power of two
    that holds the longest (`fitted_chunk`: 32 for a 32-token prompt, not 64) and still equals the recurrence
    (fp64 inputs, fp32 arithmetic inside: 1e-6)."""
    from flashnext.batch import make_segments
    from flashnext.ops.deltanet import CHUNK, fitted_chunk, gated_delta_rule

    inputs = [t.detach() for t in _inputs(cu)]
    init = torch.randn(len(cu) - 1, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    seg = make_segments(torch.tensor(cu, dtype=torch.int32), cu[-1])
    o, final = gated_delta_rule(*inputs, seg, initial_state=init)
    want = fitted_chunk(seg.max_seqlen)
    assert want < CHUNK and [key for key in seg.memo if key[0] == "gdn_chunks"] == [("gdn_chunks", want)]
    ref_o, ref_final = recurrent_gated_delta_rule(*inputs, cu, init)
    torch.testing.assert_close(o, ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-6, atol=1e-6)
    assert [fitted_chunk(n) for n in (1, 9, 16, 17, 32, 33, 64, 65, 500)] == [16, 16, 16, 32, 32, 64, 64, 64, 64]


@pytest.mark.parametrize("cu", [[0, 32], [0, 20, 52], [0, 1]], ids=["one", "two", "len1"])
def test_one_chunk_per_sequence_skips_the_scan(cu, monkeypatch):
    """When every sequence is one chunk (a short prefill at its fitted chunk size), the states and outputs come
    straight from `A S0 + B` / `M S0 + U` without the cross-chunk scan (made to fail here), forward and backward
    equal to the recurrence (fp64 inputs, fp32 arithmetic inside: 1e-6, gradients 1e-5)."""
    from flashnext.ops import deltanet

    def refuse(*args):
        raise AssertionError("the scan ran for one chunk per sequence")

    monkeypatch.setattr(deltanet._StateScan, "apply", refuse)
    inputs = _inputs(cu)
    init = torch.randn(len(cu) - 1, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    o, final = deltanet.chunk_gated_delta_rule(*inputs, cu, init.clone().requires_grad_(), chunk_size=32)
    ref_o, ref_final = recurrent_gated_delta_rule(*inputs, cu, init)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final.double(), ref_final.double(), rtol=1e-6, atol=1e-6)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=o.dtype)
    got = torch.autograd.grad((o * w).sum() + final.sum(), inputs)
    want = torch.autograd.grad((ref_o * w).sum() + ref_final.sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cu", [[0, 32, 64], [0, 64, 128]], ids=["one-chunk-each", "two-chunks-each"])
def test_chunks_without_padding_skip_the_slot_scatter(cu, monkeypatch):
    """Sequences that fill their chunks exactly (no padding slot) are laid out by reshapes: the slot scatter and
    the output gather (made to fail here) do not run; forward and backward equal the recurrence (fp64 inputs,
    fp32 arithmetic inside: 1e-6, gradients 1e-5)."""
    from flashnext.ops import deltanet

    def refuse(*args):
        raise AssertionError("a slot scatter/gather ran without padding")

    monkeypatch.setattr(deltanet.rows, "scatter_rows", refuse)
    monkeypatch.setattr(deltanet.rows, "gather_rows", lambda x, i: refuse() if i.numel() == cu[-1] else x[i])
    inputs = _inputs(cu)
    init = torch.randn(len(cu) - 1, 3, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    o, final = deltanet.chunk_gated_delta_rule(*inputs, cu, init, chunk_size=32)
    ref_o, ref_final = recurrent_gated_delta_rule(*inputs, cu, init)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(final.double(), ref_final.double(), rtol=1e-6, atol=1e-6)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=o.dtype)
    got = torch.autograd.grad((o * w).sum(), inputs)
    want = torch.autograd.grad((ref_o * w).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)
