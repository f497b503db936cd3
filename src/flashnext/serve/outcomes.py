"""The engine's request bookkeeping after a forward: record what a step gave each request, end it or tell its client.

`Outcomes.sample` samples due logits rows (`Sampler.sample`) and `Outcomes.verify` settles a speculating entry's
drafts (`Speculator.settle`); both record the emitted tokens through `emit` (a constrained request's grammar
advances first, then `Sampler.emit` appends them and checks stop conditions). `finish` ends a request (idempotent):
frees its slot, counts it, tells its client and ends its never-forked children with it; `notify` calls a request's
`on_update` and cancels the request when that callback raises (its client is gone: the others keep being served).
The requests finished since the last `take()` are what `Engine.step` returns. Failures stay the failing request's
alone: a row that cannot be sampled, a broken grammar or a failed stop check ends that request with "error".
"""

from __future__ import annotations

import logging
import time

import torch

from flashnext.serve import grammar
from flashnext.serve.request import Request
from flashnext.serve.sampler import Sampler
from flashnext.serve.sampling import FAILED
from flashnext.serve.scheduler import Scheduler
from flashnext.serve.speculative import SpecForward, Speculator
from flashnext.serve.stats import EngineStats

__all__ = ["Outcomes"]

log = logging.getLogger("flashnext.serve")


class Outcomes:
    """Records sampled and verified tokens, finishes and notifies requests (see the module doc); `speculator` is
    None for a model without an MTP head."""

    def __init__(self, scheduler: Scheduler, sampler: Sampler, stats: EngineStats, speculator: Speculator | None):
        self.scheduler, self.sampler, self.stats, self.speculator = scheduler, sampler, stats, speculator
        self.finished: list[Request] = []  # finished since the last `take()`

    def take(self) -> list[Request]:
        """The requests (choices) finished since the last call."""
        done, self.finished = self.finished, []
        return done

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Sample row i of `logits` for `reqs[i]` and record it; a row that cannot be sampled ends its request."""
        tokens, chosen, top, errors = self.sampler.sample(grammar.mask_rows(logits, reqs), reqs)
        for i, req in enumerate(reqs):
            if tokens[i] != FAILED:
                self.emit(req, [tokens[i]], [chosen[i]] if chosen is not None else None, top, [i])
                continue
            msg = errors.get(i, "the model's logits for this request are not finite (NaN or inf)")
            log.error("request %s failed: %s", req.request_id, msg)
            self.finish(req, "error", msg)

    def verify(self, req: Request, i: int, n: int, out: SpecForward) -> int:
        """Accept entry i's drafts, roll its slot back past the first rejected one (`Speculator.settle`), record
        the emitted tokens; returns how many were emitted."""
        verdict, error = self.speculator.settle(req, i, n, out)
        if verdict is None:
            self.finish(req, "error", error)
            return 0
        self.emit(req, verdict.tokens, verdict.chosen, verdict.top, list(range(len(verdict.tokens))))
        return len(verdict.tokens)

    def emit(self, req: Request, tokens: list[int], chosen: list[float] | None, top, rows: list[int]) -> None:
        """Record `tokens` (`Sampler.emit`; a constrained request's grammar advances first); then finish or notify
        the request."""
        if (broken := grammar.accept_emitted(req, tokens)) is not None:
            self.finish(req, "error", broken)
            return
        reason, error = self.sampler.emit(req, tokens, chosen, top, rows)
        if reason is None:
            self.notify(req)
        else:
            self.finish(req, reason, error)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End `req` (idempotent): free its slot, count it, tell its client; pending children share its end."""
        if req.finished:
            return
        req.finish_reason, req.error, req.finish_time = reason, error, time.perf_counter()
        req.images = req.prompt_embeds = None
        req.drafts = []
        self.scheduler.release(req)
        forks, req.forks = req.forks, []
        self.stats.finish(req)
        self.finished.append(req)
        self.notify(req)
        for child in forks:  # never forked: they share the parent's prompt, so its fate
            self.finish(child, reason, error)

    def notify(self, req: Request) -> None:
        """Call the request's `on_update`; a callback that raises cancels its request (its group)."""
        if req.on_update is None:
            return
        try:
            req.on_update(req)
        except Exception as e:  # its client is gone or broken: cancel the request, keep serving the others
            log.warning("update callback of %s failed (%s: %s); cancelling it", req.request_id, type(e).__name__, e)
            if not req.finished:
                self.scheduler.cancel(req.group)

    def fail_all(self, reason: str, message: str) -> list[Request]:
        """End every queued, running and incoming request (see `Engine.fail_all`); returns all finished ones."""
        self.scheduler.take_incoming(aborts=False)
        for req in list(self.scheduler.unfinished()):
            try:
                self.finish(req, reason, message)
            except Exception:
                log.exception("could not finish request %s cleanly", req.request_id)
                req.finish_reason, req.error, req.slot = reason, message, None
                self.finished.append(req)
                self.notify(req)
        self.scheduler.clear()
        return self.take()
