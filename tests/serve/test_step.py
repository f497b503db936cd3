"""The serving step against the training forward: chunked prefill, decode, padding, slot reuse, fixed buffers."""

from __future__ import annotations

import pytest
import torch
from serve_helpers import run_step, slot_state, small_model

from flashnext.serve.cache import StateCache


@pytest.fixture
def model(small_config):
    return small_model(small_config)


def _rand(n: int, seed: int, vocab: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _feed(model, cache, slot: int, ids: list[int], chunks: list[int]) -> list[torch.Tensor]:
    """Feed `ids` into `slot` in chunks of the given sizes; logits of each chunk's last token."""
    out, done = [], 0
    for n in chunks:
        out.append(run_step(model, cache, [(slot, done, ids[done : done + n])])[0])
        done += n
    assert done == len(ids)
    return out


@pytest.mark.parametrize("chunks", [[37], [5, 11, 1, 20], [1] * 37], ids=["one-shot", "chunked", "decode"])
def test_step_matches_full_forward(model, chunks):
    """Every chunking gives the full forward's logits at each chunk end (QSA blocks, budget, PLE, GDN crossed)."""
    ids = _rand(37, 1)
    with torch.no_grad():
        full = model(torch.tensor(ids)).logits
    cache = StateCache(model, max_slots=2, max_model_len=64)
    got = _feed(model, cache, cache.allocate(), ids, chunks)
    ends = torch.tensor(chunks).cumsum(0) - 1
    torch.testing.assert_close(torch.stack(got), full[ends], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_shot_state(model):
    ids = _rand(30, 2)
    a, b = (StateCache(model, max_slots=1, max_model_len=64) for _ in range(2))
    la = _feed(model, a, a.allocate(), ids, [30])[-1]
    lb = _feed(model, b, b.allocate(), ids, [7, 1, 13, 9])[-1]
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    for x, y in zip(slot_state(a, 0), slot_state(b, 0), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_mixed_batch_equals_alone(model):
    """Prefill chunks and decodes of several slots in one stream give each slot's own result."""
    ids = [_rand(n, 10 + n) for n in (9, 17, 4)]
    alone = []
    for seq in ids:
        cache = StateCache(model, max_slots=1, max_model_len=64)
        alone.append(_feed(model, cache, cache.allocate(), seq, [len(seq) - 1, 1]))
    cache = StateCache(model, max_slots=3, max_model_len=64)
    slots = [cache.allocate() for _ in ids]
    first = run_step(model, cache, [(s, 0, seq[:-1]) for s, seq in zip(slots, ids, strict=True)])
    last = run_step(model, cache, [(s, len(seq) - 1, seq[-1:]) for s, seq in zip(slots, ids, strict=True)])
    for i in range(3):
        torch.testing.assert_close(first[i], alone[i][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[i], alone[i][1], atol=1e-5, rtol=1e-5)


def _three_slot_caches(model, n: int) -> list[StateCache]:
    caches = [StateCache(model, max_slots=3, max_model_len=64) for _ in range(n)]
    for cache in caches:
        for s in range(3):
            cache.allocate()
            run_step(model, cache, [(s, 0, _rand(6 + s, 20 + s))])
    return caches


PLAIN = [(0, 6, [5]), (1, 7, _rand(4, 3))]


def test_zero_length_entries_are_inert(model):
    """Zero-length entries (even on slots that are in use) produce no row and write no state.

    The slot only they name stays bit-identical. The live entries' results match to float rounding only: the
    extra entries add no token but change the entry count, hence the shapes of the per-entry state gathers and
    recurrences (and the path: indexed instead of a slot run), so bitwise equality is not given by construction.
    """
    a, b = _three_slot_caches(model, 2)
    out_a = run_step(model, a, PLAIN)
    out_b = run_step(model, b, [(2, 8, []), PLAIN[0], (2, 8, []), PLAIN[1], (0, 6, [])])
    assert out_b.shape == out_a.shape  # no rows for the zero-length entries
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(x[2:], y[2:])  # slot 2 (zero-length entries only) and the scratch slot
        torch.testing.assert_close(x[:2], y[:2], atol=1e-5, rtol=1e-5)


def test_padding_entries_are_inert(model):
    """Scratch-slot padding entries produce no rows and write no request slot.

    Slots outside the step stay bit-identical. The real entries' results match to float rounding only: padding
    tokens change the row count of every GEMM, and CPU GEMM blocking (hence summation order) depends on it.
    """
    a, b = _three_slot_caches(model, 2)
    out_a = run_step(model, a, PLAIN)
    scratch = b.scratch_slot
    out_b = run_step(model, b, [PLAIN[0], (scratch, 0, _rand(3, 4)), PLAIN[1], (scratch, 0, [9])])
    assert out_b.shape == out_a.shape
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(x[2], y[2])  # slot 2 was not in the step
        torch.testing.assert_close(x[:2], y[:2], atol=1e-5, rtol=1e-5)


def test_slot_reuse_leaves_no_trace(model):
    ids = _rand(21, 7)
    fresh = StateCache(model, max_slots=2, max_model_len=64)
    expected = _feed(model, fresh, fresh.allocate(), ids, [13, 8])
    cache = StateCache(model, max_slots=2, max_model_len=64)
    slot = cache.allocate()
    _feed(model, cache, slot, _rand(40, 8), [40])
    cache.release(slot)
    assert cache.allocate() == slot
    assert all(torch.equal(x, y) for x, y in zip(slot_state(cache, slot), slot_state(fresh, 1), strict=True))
    got = _feed(model, cache, slot, ids, [13, 8])
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x, y)


def test_buffers_keep_shapes_and_addresses(model):
    cache = StateCache(model, max_slots=2, max_model_len=32)
    before = [(b.data_ptr(), b.shape) for b in cache.buffers()]
    slot = cache.allocate()
    _feed(model, cache, slot, _rand(20, 9), [9, 1, 10])
    cache.release(slot)
    assert [(b.data_ptr(), b.shape) for b in cache.buffers()] == before


def test_decode_step_segments_equal_make_segments():
    """make_step's decode shortcut builds the same Segments as the general path."""
    from flashnext.batch import make_segments
    from flashnext.model.state import make_step

    cached = [5, 0, 17]
    step = make_step([0, 1, 2, 3], [2, 0, 1], cached, scratch_slot=3)
    ref = make_segments(torch.tensor([0, 1, 2, 3], dtype=torch.int32), 3, torch.tensor(cached))
    for name in ("cu_seqlens", "position_ids", "seq_idx", "seq_start", "pos_in_seq"):
        assert torch.equal(getattr(step.seg, name), getattr(ref, name)), name
    assert (step.seg.lengths, step.seg.cu_host, step.seg.max_seqlen) == (ref.lengths, ref.cu_host, ref.max_seqlen)


@pytest.mark.parametrize(
    ("slots", "run"),
    [([0, 1, 2], (0, 3)), ([1, 2], (1, 2)), ([2, 0, 1], None), ([0, 2], None), ([0, 3], None)],
    ids=["all", "tail", "unordered", "gap", "padding"],
)
def test_slot_run_detection(slots, run):
    from flashnext.model.state import make_step

    step = make_step(list(range(len(slots) + 1)), slots, [4] * len(slots), scratch_slot=3)
    assert step.slot_run == run


@pytest.mark.parametrize("tokens", [1, 3], ids=["decode", "prefill"])
def test_slot_run_path_equals_indexed_path(model, tokens):
    """A batch on consecutive slots reads/writes state as cache slices (in place): same logits and states as
    the gather/scatter path, bit for bit. Bitwise by construction: same entries, shapes and kernels, and the run
    starts at slot 0, so the slices sit at the same (allocation) alignment as the gathered copies."""
    from flashnext.model.state import make_step

    a, b = _three_slot_caches(model, 2)
    entries = [(s, 6 + s, _rand(tokens, 30 + s)) for s in range(3)]
    cu = [0]
    for e in entries:
        cu.append(cu[-1] + len(e[2]))
    ids = torch.tensor([t for e in entries for t in e[2]])
    outs = []
    for cache, run in ((a, True), (b, False)):
        step = make_step(cu, [e[0] for e in entries], [e[1] for e in entries], cache.scratch_slot)
        assert step.slot_run == (0, 3)
        if not run:
            step.slot_run = None
        with torch.no_grad():
            outs.append(model.forward_step(ids, step, cache))
    assert torch.equal(outs[0], outs[1])
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(x, y)


def test_copy_slot_forks_a_sequence(model):
    """`copy_slot` copies every buffer row of a slot (and touches no other slot); the copy then continues the
    sequence as the original does. (Different slots are different memory, hence the float tolerance.)"""
    ids = _rand(13, 11)
    cache = StateCache(model, max_slots=3, max_model_len=64)
    a, b, c = (cache.allocate() for _ in range(3))
    _feed(model, cache, a, ids, [13])
    _feed(model, cache, c, _rand(5, 12), [5])
    other = slot_state(cache, c)
    cache.copy_slot(a, b)
    assert all(torch.equal(x, y) for x, y in zip(slot_state(cache, b), slot_state(cache, a), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(slot_state(cache, c), other, strict=True))
    out_a = run_step(model, cache, [(a, 13, [7])])
    out_b = run_step(model, cache, [(b, 13, [7])])
    torch.testing.assert_close(out_b, out_a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("accepted", [0, 2, 5], ids=["none", "some", "all"])
def test_rollback_to_accepted_length_equals_never_seen(model, accepted):
    """Speculative decoding's rollback on the plain step: snapshot, a step with 5 draft tokens (crossing QSA
    blocks), restore, then feed the accepted drafts with the continuation. The slot then computes what a slot that
    never saw the rejected drafts computes, and its window/recurrent state equals that slot's; nothing the rejected
    drafts wrote (keys, values, raw and block keys past the accepted length) is visible to later queries.

    Same model instance, same slot, same step shapes in both caches: equal up to fp32 rounding (1e-6), not asserted
    bitwise since the two caches' buffers sit at different addresses (CPU GEMM paths may depend on alignment)."""
    prefix, drafts, more = _rand(13, 40), _rand(5, 41), _rand(6, 42)
    seen, fresh = (StateCache(model, max_slots=1, max_model_len=64) for _ in range(2))
    for cache in (seen, fresh):
        _feed(model, cache, cache.allocate(), prefix, [13])
    snap = seen.snapshot([0])
    run_step(model, seen, [(0, 13, drafts)])  # the verify step: every draft's state written
    seen.restore(snap)
    keep = drafts[:accepted] + more
    got = [run_step(model, seen, [(0, 13, keep)])[0]]
    want = [run_step(model, fresh, [(0, 13, keep)])[0]]
    for i, tok in enumerate(_rand(4, 43)):  # decode on: positional rows past the length are rewritten first
        got.append(run_step(model, seen, [(0, 13 + len(keep) + i, [tok])])[0])
        want.append(run_step(model, fresh, [(0, 13 + len(keep) + i, [tok])])[0])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=1e-6, rtol=1e-6)
    non_positional = [b for b, kind in seen._kinds if kind != "positional"]
    for x, y in zip(seen.buffers(), fresh.buffers(), strict=True):
        if any(x is b for b in non_positional):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_rollback_without_restore_diverges(model):
    """The control: feeding the continuation over the drafts' state (no restore) gives different logits."""
    prefix, drafts, more = _rand(13, 40), _rand(5, 41), _rand(6, 42)
    seen, fresh = (StateCache(model, max_slots=1, max_model_len=64) for _ in range(2))
    for cache in (seen, fresh):
        _feed(model, cache, cache.allocate(), prefix, [13])
    run_step(model, seen, [(0, 13, drafts)])
    got = run_step(model, seen, [(0, 13, more)])[0]
    want = run_step(model, fresh, [(0, 13, more)])[0]
    assert (got - want).abs().max() > 1e-3


def test_step_kinds():
    """A step says what it is: make_step a decode step when every entry has one token, a prefill step otherwise, or
    the kind asked (verify); the static decode step is a decode step; a training forward takes the plain path."""
    from flashnext.model.state import DECODE, PREFILL, TRAIN, TRAIN_STEP, VERIFY, make_decode_step, make_step, step_of

    assert make_step([0, 1, 2], [0, 1], [3, 4], scratch_slot=2).kind == DECODE
    prefill = make_step([0, 1, 4], [0, 1], [3, 4], scratch_slot=2)
    assert (prefill.kind, prefill.fused, prefill.static) == (PREFILL, True, False)
    assert make_step([0, 1, 4], [0, 1], [3, 4], scratch_slot=2, kind=VERIFY).kind == VERIFY
    static = make_decode_step(torch.tensor([0, 2]), torch.tensor([3, 0]), scratch_slot=2)
    assert (static.kind, static.fused, static.static) == (DECODE, True, True)
    assert (TRAIN_STEP.kind, TRAIN_STEP.fused, TRAIN_STEP.static) == (TRAIN, False, False)
    assert step_of(None) is TRAIN_STEP
    with pytest.raises(ValueError, match="'train'"):
        make_step([0, 1], [0], [0], scratch_slot=1, kind=TRAIN)


def _rotary(positions, dtype):
    """A stand-in rotary: cos = the position, sin = minus it (enough to see where each block is rotated)."""
    p = positions.to(dtype)[:, None]
    return p, -p


def test_plan_blocks_returns_the_plan_and_leaves_the_step():
    """plan_blocks returns the QSA blocks the live entries complete, rotated at their first positions, and the most
    complete blocks a query sees; it writes nothing into the step (the model stores the plan as `step.blocks`)."""
    from flashnext.model.state import make_step, plan_blocks

    # c = 4: slot 0 (2 cached + 7) completes blocks 0 and 1; slot 1 (5 + 2) none; the padding entry (scratch slot
    # 3, 4 tokens) is not live, but its queries count toward the most visible blocks.
    step = make_step([0, 7, 9, 13], [0, 1, 3], [2, 5, 0], scratch_slot=3)
    plan = plan_blocks(step, 4, _rotary, torch.float32)
    assert step.blocks is None
    assert plan.slot.tolist() == [0, 0] and plan.block.tolist() == [0, 1]
    assert plan.cos[:, 0].tolist() == [0.0, 4.0] and plan.sin[:, 0].tolist() == [-0.0, -4.0]
    assert plan.done is None and plan.most == 2


def test_static_plan_is_one_candidate_block_per_entry():
    """A static step plans each entry's last block its token can complete, `done` where it does (padding: never)."""
    from flashnext.model.state import make_decode_step, plan_blocks

    step = make_decode_step(torch.tensor([0, 1, 2]), torch.tensor([3, 5, 7]), scratch_slot=2)
    plan = plan_blocks(step, 4, _rotary, torch.float32)
    assert step.blocks is None
    assert plan.slot.tolist() == [0, 1, 2] and plan.block.tolist() == [0, 0, 1]
    assert plan.cos[:, 0].tolist() == [0.0, 0.0, 4.0] and plan.done.tolist() == [True, False, False]
