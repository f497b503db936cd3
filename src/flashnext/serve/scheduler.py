"""Which requests a step feeds, and how much of each: the engine's queue, slots, chunked prefill and preemption.

`Scheduler` owns the queued (`waiting`), slot-holding (`running`) and preempted (`suspects`) requests over a
`StateCache`'s slots. `schedule` plans a step as (request, tokens to feed) pairs within a token budget; `advance`
counts what a successful step fed; `preempt` resets the slots of a failed step's requests so they recompute from
scratch (see `serve.engine` for the recovery rounds); `fork` starts an n-choice request's children from their
parent's prefilled state; `release` takes a finished request out of all of it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from flashnext.serve.cache import StateCache
from flashnext.serve.request import Request

__all__ = ["Scheduler"]


class Scheduler:
    """Request queue, slot assignment and step plans over `cache`'s slots."""

    def __init__(self, cache: StateCache):
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self.suspects: list[Request] = []  # in a failed step, to recompute one at a time

    def unfinished(self) -> Iterator[Request]:
        """Every queued or running request, with children still waiting for their parent's prefill."""
        for req in itertools.chain(self.waiting, self.running):
            yield req
            yield from req.forks

    def schedule(self, budget: int, admitting: bool, weight_version: int) -> list[tuple[Request, int]]:
        """(request, tokens to feed) pairs: decodes, then prefill chunks, then admissions, within `budget` tokens.

        While suspects of a failed step remain, a step runs the first of them alone (its recompute, chunked).
        `admitting` False starts no queued request; an admitted one records `weight_version`.
        """
        if self.suspects:
            req = self.suspects[0]
            return [(req, self.chunk(req, budget))]
        plan = []
        decoding = [r for r in self.running if r.num_cached >= len(r.prompt_ids)]
        prefilling = [r for r in self.running if r.num_cached < len(r.prompt_ids)]
        for req in decoding + prefilling:  # decodes first: one token each (more after rejected drafts)
            if budget == 0:
                break
            n = self.chunk(req, budget)
            plan.append((req, n))
            budget -= n + len(req.drafts)
        # A request with n choices is admitted when its n slots are free (its children reserve theirs now).
        while admitting and budget > 0 and self.waiting and self.cache.free_slots > len(self.waiting[0].forks):
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            for child in req.forks:
                child.slot = self.cache.allocate()
            for choice in req.choices:
                choice.weight_version = weight_version
            self.running.append(req)
            n = min(budget, len(req.prompt_ids))
            plan.append((req, n))
            budget -= n
        return plan

    @staticmethod
    def chunk(req: Request, budget: int) -> int:
        """Known tokens of `req` to feed in a step with `budget` tokens left: all not yet cached (a decode's one
        token, a replay after rejected drafts, a prompt's rest) or a chunk of them. Its drafts ride along only
        when the entry reaches its last known token, trimmed to the budget (else they are dropped)."""
        known = req.num_tokens - req.num_cached
        n = min(budget, known)
        req.drafts = req.drafts[: budget - n] if n == known else []
        return n

    def advance(self, req: Request, n: int) -> bool:
        """Count `n` tokens of `req` fed by a successful step; True when its next token is due (it fed everything
        known; a suspect that got there has recomputed its whole history alone and is cleared)."""
        req.num_cached += n
        if req.num_cached >= len(req.prompt_ids):
            req.prompt_embeds = None  # prefilled: nothing of the vision tower stays
        if req.num_cached != req.num_tokens:
            return False
        if req.suspect:
            req.suspect = False
            self.suspects.remove(req)
        return True

    def fork(self, parent: Request) -> list[Request]:
        """Give the parent's pending children its prefilled state (their reserved slots) and start them."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.cache.copy_slot(parent.slot, child.slot)
            child.num_cached, child.mtp_cells = parent.num_cached, parent.mtp_cells
            child.routed = list(parent.routed)  # the shared prompt's experts
            self.running.append(child)
        return children

    def preempt(self, plan: list[tuple[Request, int]]) -> None:
        """Reset the slots of a failed step's requests (partly written) and make them suspects: each recomputes
        its whole history, alone, from the start."""
        for req, _ in plan:
            self.cache.reset_slot(req.slot)  # partly written by the failed step
            req.num_cached = req.mtp_cells = 0
            req.prompt_embeds, req.drafts = None, []
            req.routed = []  # recomputed from the start
            if not req.suspect:
                req.suspect = True
                self.suspects.append(req)

    def release(self, req: Request) -> None:
        """Take a finishing request out of the queue, the running set and the suspects, freeing its slot."""
        if req.suspect:
            req.suspect = False
            self.suspects.remove(req)
        if req.slot is not None:
            slot, req.slot = req.slot, None
            self.cache.release(slot)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def clear(self) -> None:
        """Forget every request (after `Engine.fail_all` ended them)."""
        self.running.clear()
        self.waiting.clear()
        self.suspects.clear()
