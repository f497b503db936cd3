"""`Scheduler` on its own (no model): step plans within the budget, admission of n-choice groups, `advance`."""

from flashnext.serve.request import Request
from flashnext.serve.sampling import SamplingParams
from flashnext.serve.scheduler import Scheduler


class Slots:
    """The slot bookkeeping of a `StateCache`, without buffers (what `Scheduler` uses of it)."""

    def __init__(self, n: int):
        self.free = list(range(n))
        self.copies: list[tuple[int, int]] = []
        self.resets: list[int] = []

    @property
    def free_slots(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def reset_slot(self, slot: int) -> None:
        self.resets.append(slot)


def request(rid: str, prompt_len: int, n: int = 1, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, n=n)
    choices = [Request(rid if i == 0 else f"{rid}/{i}", list(range(1, prompt_len + 1)), params, index=i)
               for i in range(n)]  # fmt: skip
    parent = choices[0]
    parent.choices, parent.forks = choices, choices[1:]
    return parent


def test_plan_decodes_first_then_chunks_then_admissions_within_budget():
    sched = Scheduler(Slots(4))
    a, b, c = request("a", 3), request("b", 10), request("c", 5)
    for r in (a, b):
        sched.submit(r)
    assert sched.take_incoming() == set()
    assert sched.schedule(8, True, 7) == [(a, 3), (b, 5)]  # b's prompt is chunked at the budget
    assert (a.slot, b.slot, a.weight_version) == (0, 1, 7)
    sched.advance([(a, 3), (b, 5)], None)
    a.output_ids.append(9)  # a sampled its first token: a decode of one token now
    sched.submit(c)
    sched.take_incoming()
    assert sched.schedule(8, False, 7) == [(a, 1), (b, 5)]  # not admitting: c waits
    assert list(sched.waiting) == [c]
    assert sched.schedule(8, True, 7) == [(a, 1), (b, 5), (c, 2)]  # one decode token, a chunk, an admission


def test_n_choices_wait_for_all_their_slots_and_fork_after_the_prompt():
    sched = Scheduler(Slots(2))
    solo, group = request("solo", 2), request("g", 3, n=2)
    sched.submit(solo)
    sched.submit(group)
    sched.take_incoming()
    assert sched.schedule(100, True, 0) == [(solo, 2)]  # the group needs 2 free slots, only 1 is
    sched.release(solo)
    assert sched.schedule(100, True, 0) == [(group, 3)]
    fed = sched.advance([(group, 3)], None)
    child = group.choices[1]
    assert fed.to_sample == [group, child] and fed.rows == [0, 0]
    assert sched.cache.copies == [(group.slot, child.slot)] and child.num_cached == 3
    assert sched.running == [group, child]


def test_advance_reports_due_rows_and_prompt_only_requests():
    sched = Scheduler(Slots(3))
    long, scored = request("long", 6), request("scored", 2, max_tokens=0)
    for r in (long, scored):
        sched.submit(r)
    sched.take_incoming()
    plan = sched.schedule(5, True, 0)
    assert plan == [(long, 5)]  # the budget ran out inside the first prompt: no admission
    fed = sched.advance(plan, None)
    assert fed.to_sample == [] and fed.prompt_fed == 5 and fed.cells == [(long, 0)]
    plan = sched.schedule(6, True, 0)
    assert plan == [(long, 1), (scored, 2)]
    fed = sched.advance(plan, None)
    assert fed.to_sample == [long] and fed.rows == [0] and fed.scored_only == [scored] and fed.prompt_fed == 3
    assert fed.cells == [(long, 0), (scored, 1)]


def test_preempted_requests_recompute_alone_then_rejoin():
    sched = Scheduler(Slots(2))
    a, b = request("a", 3), request("b", 4)
    for r in (a, b):
        sched.submit(r)
    sched.take_incoming()
    plan = sched.schedule(16, True, 0)
    sched.preempt(plan, "RuntimeError: boom")
    assert sched.suspects == [a, b] and a.num_cached == b.num_cached == 0 and sched.cache.resets == [0, 1]
    assert sched.schedule(2, True, 0) == [(a, 2)]  # alone and chunked
    sched.advance([(a, 2)], None)
    assert sched.schedule(16, True, 0) == [(a, 1)]
    fed = sched.advance([(a, 1)], None)
    assert fed.to_sample == [a] and fed.recomputed == 1 and sched.suspects == [b]
    assert sched.schedule(16, True, 0) == [(b, 4)]
