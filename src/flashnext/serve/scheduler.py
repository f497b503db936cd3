"""Which requests a step feeds, and how much of each: the engine's queue, slots, chunked prefill and preemption.

`Scheduler` owns the requests handed in by other threads (`submit`, `cancel`: thread-safe; `take_incoming`
queues them on the engine thread), the queued (`waiting`), slot-holding (`running`) and preempted (`suspects`)
requests over a `StateCache`'s slots. `schedule` plans a step as (request, tokens to feed) pairs within a token
budget; `advance` counts what a successful step fed and says which entries are due a token (`Fed`), starting an
n-choice request's children from their parent's prefilled state (`fork`); `preempt` resets the slots of a failed
step's requests so they recompute from scratch (see `serve.engine` for the recovery rounds); `release` takes a
finished request out of all of it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from flashnext.serve.cache import StateCache
from flashnext.serve.prefix_cache import PrefixCache
from flashnext.serve.request import Request

__all__ = ["Fed", "Scheduler"]

log = logging.getLogger("flashnext.serve")


@dataclass
class Fed:
    """What a successful step fed, entry by entry (`Scheduler.advance`): the requests due a sampled token and
    their logits `rows` (a forked child shares its parent's row), entries whose drafts are to be verified
    (request, entry, tokens fed), requests that only scored their prompt (`max_tokens` 0: they end), the
    (request, entry) cells of every request the step advanced (its MTP cells, `serve.speculative`), and the
    prompt and recomputed tokens it fed (counters)."""

    rows: list[int] = field(default_factory=list)
    to_sample: list[Request] = field(default_factory=list)
    to_verify: list[tuple[Request, int, int]] = field(default_factory=list)
    scored_only: list[Request] = field(default_factory=list)
    cells: list[tuple[Request, int]] = field(default_factory=list)
    prompt_fed: int = 0
    recomputed: int = 0


class Scheduler:
    """Request queue, slot assignment and step plans over `cache`'s slots."""

    def __init__(self, cache: StateCache, prefix: PrefixCache | None = None):
        self.cache = cache
        self.prefix = prefix  # resumes admitted prompts, ends chunks at its snapshot points (None: off)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self.suspects: list[Request] = []  # in a failed step, to recompute one at a time
        self._lock = threading.Lock()
        self._incoming: deque[Request] = deque()  # submitted by other threads, queued at the next step
        self._aborts: set[str] = set()

    def submit(self, req: Request) -> None:
        """Hand a new request (a parent with its choices) in; queued at the next step (thread-safe)."""
        with self._lock:
            self._incoming.append(req)

    def cancel(self, request_id: str) -> None:
        """Ask for a request id or group to be cancelled at the next step (thread-safe)."""
        with self._lock:
            self._aborts.add(request_id)

    def take_incoming(self, aborts: bool = True) -> set[str]:
        """Queue the submitted requests; the ids and groups to cancel now (none taken with `aborts` False)."""
        with self._lock:
            self.waiting.extend(self._incoming)
            self._incoming.clear()
            if not aborts:
                return set()
            taken, self._aborts = self._aborts, set()
        return taken

    def has_unfinished(self) -> bool:
        """Whether a request is submitted, queued or running (thread-safe)."""
        with self._lock:
            pending = bool(self._incoming)
        return pending or bool(self.waiting) or bool(self.running)

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
            n = self.chunk(req, budget if self.prefix is None else self.prefix.limit(req, budget))
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
            if self.prefix is not None:  # resume from a cached prefix (sets num_cached)
                self.prefix.admit(req)
                n = self.prefix.limit(req, min(budget, len(req.prompt_ids) - req.num_cached))
            else:
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

    def advance(self, plan: list[tuple[Request, int]], routing: torch.Tensor | None, first_row=None) -> Fed:
        """Count the tokens a successful step fed each entry of `plan` (a request finished meanwhile is skipped)
        and find the entries due a token: those that fed everything they know (a suspect that got there has
        recomputed its whole history alone and is cleared). `routing`: the stream's routed experts [T, L, k]
        (requests that asked keep their rows; they never carry drafts); `first_row[i]`: entry i's sampled row
        in a speculative step's logits (else row i). A prefilled n-choice prompt forks its children here."""
        fed = Fed()
        offset = 0
        for i, (req, n) in enumerate(plan):
            if req.finished:  # failed on its prompt's log-probs just now (its slot is free; row i stays unread)
                continue
            if req.suspect:
                fed.recomputed += n
            else:
                fed.prompt_fed += max(0, min(n, len(req.prompt_ids) - req.num_cached))
            if req.params.return_routed_experts:
                req.record_routing(routing[offset : offset + n])
            offset += n + len(req.drafts)  # the stream carries each entry's drafts after its tokens
            req.num_cached += n
            if req.num_cached >= len(req.prompt_ids):
                req.prompt_embeds = None  # prefilled: nothing of the vision tower stays
            fed.cells.append((req, i))
            if req.num_cached != req.num_tokens:  # more known tokens to feed: no token due yet
                continue
            if req.suspect:  # recomputed its whole history alone: cleared
                req.suspect = False
                self.suspects.remove(req)
            if req.drafts:
                fed.to_verify.append((req, i, n))
            elif req.params.max_tokens == 0:  # the prompt was only to be scored; its choices end with it
                fed.scored_only.append(req)
            else:
                row = i if first_row is None else first_row[i]
                fed.rows.append(row)
                fed.to_sample.append(req)
                for child in self.fork(req):  # prompt prefilled: its other choices start from its state
                    fed.rows.append(row)
                    fed.to_sample.append(child)
                    fed.cells.append((child, i))
        return fed

    def fork(self, parent: Request) -> list[Request]:
        """Give the parent's pending children its prefilled state (their reserved slots) and start them."""
        children, parent.forks = parent.forks, []
        for child in children:
            self.cache.copy_slot(parent.slot, child.slot)
            child.num_cached, child.mtp_cells = parent.num_cached, parent.mtp_cells
            child.num_cached_prompt, child.resume_residual = parent.num_cached_prompt, parent.resume_residual
            child.routed = list(parent.routed)  # the shared prompt's experts
            self.running.append(child)
        return children

    def preempt(self, plan: list[tuple[Request, int]], what: str) -> None:
        """Reset the slots of a step's requests whose forward failed (`what`; the slots are partly written) and
        make them suspects: each recomputes its whole history, alone, from the start."""
        ids = ", ".join(req.request_id for req, _ in plan)
        log.warning("model step of %d requests failed (%s); recomputing them one at a time: %s", len(plan), what, ids)
        for req, _ in plan:
            if self.prefix is not None:
                self.prefix.release(req, keep=False)  # its slot is unsound; it recomputes without the cache
            self.cache.reset_slot(req.slot)  # partly written by the failed step
            req.num_cached = req.mtp_cells = 0
            req.resume_residual = None
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
        if self.prefix is not None:  # keeps the blocks it prefilled (a failed request's slot is unsound)
            self.prefix.release(req, keep=req.finish_reason != "error")
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
