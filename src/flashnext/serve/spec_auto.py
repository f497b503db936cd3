"""Adaptive speculative decoding (`num_speculative_tokens="auto"`): draft only where it pays, per request.

Drafting k tokens costs k draft steps (the MTP head: its cell step, then chained steps) and k more fed tokens per
request in the verify step; it yields the accepted drafts plus the target's one token. With per-position
acceptances a_1, a_2, ... (draft j accepted with probability a_j once the ones before it were), a verify step with
k drafts emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens on average. Measured against a plain step of
the same batch (time t0):
- c = (time of one draft step) / t0, the draft's cost ratio;
- v = B * m / t0, where m is the marginal time of one more fed token in the step and B the batch: every request
  of the batch feeding k more tokens adds B*k*m. v grows with the batch: past the batch where verification stops
  being almost free, no k pays and drafting turns itself off.
Expected tokens per unit time relative to plain decoding: gain(k) = E(k) / (1 + k*(c + v)); `choose_k` takes the
k in [0, k_max] maximising it, and 0 unless the best gain clears `min_gain` (gain(0) = 1).

`AutoSpec` keeps what the choice needs:
- per request and draft position (the choice past batch 1 takes the running requests' mean, one k for every auto
  request of a step: see `draft_count`), an exponentially weighted acceptance (each verified draft a Bernoulli trial of
  its position: accepted drafts are successes, the first rejected one a failure, the positions after it not
  tried), seeded from the engine-wide rates (themselves seeded at `prior_rate`). Per position because a head's
  first draft, one step from the trunk's residual, is accepted far more often than the chained ones after it (the
  trained tiny head: ~0.8 against ~0.5): one pooled rate under-rates k = 1 and over-rates long drafts;
- per batch bucket (powers of two), the step time as a decayed least-squares line in the tokens fed beyond one
  per request (intercept t0, slope m), from decode-only steps; and the draft time per draft step. Until a bucket
  has two distinct points the `prior_c` / `prior_v` ratios stand in. Tests inject fixed ratios (`fixed`).
A request whose choice is 0 steps aside: its `spec_k` goes to 0, so its steps are plain (no residual, no head
cells, the decode graph again when nothing else speculates). Every `probe_every` of its steps it is re-armed for
one probe: the head restarts from its current position (cells skipped while it was plain are not fed: the
probe's drafts may be poorer; they are proposals, so tokens stay exact) and proposes one draft, whose verdict
updates its acceptance; the next choice keeps it drafting or sends it back, and each probe that sends it back
doubles the wait before the next (up to `max_backoff`). No probe runs while even drafts certain to be accepted
would not gain `probe_gain` (1.2) at the current batch (its measured costs alone decide it, a measured k's steps
counted at k + 1 tokens per entry: a probe is itself a speculative step, and where certain drafts would gain a few
percent, measured costs within their noise, probes only cost), and once they are measured, queued requests that
could not gain as much start plain.
Measured tokens per second price k once there are enough (`gains`): per batch bucket and mode k (the step's drafts
per entry, rounded, an entry without drafts counting its request's latest choice: the replay step that follows
rejections in two steps running, re-feeding 5-7 tokens and emitting one, belongs to k, a request's last step (no
room for drafts) does not; a lone probe in a plain batch prices nothing), the whole decode-only engine steps (model
step, verification, rollback, the next proposal, host work) and the tokens they emitted; seconds per token over the
recent samples within 1.5x the low envelope of the steps where every entry drafted (`spec_costs.Times`: this box's
load comes in bursts of ~0.5 s that double a few steps in a row: a plain mean of the first samples read a k = 2 step
at 3.5 plain steps and turned drafting off for good), against the plain step's envelope (fast down, slow up: every
plain step does the same work) over its batch, from plain steps where every entry fed its one token (a replay after
rejected drafts takes the slower multi-token path: tiny config, batch 16, such a step read 1.3x a plain one and
k = 1 at 0.9x plain passed for a gain). With `min_samples` of them, the latest within `forget` decode steps, gain(k)
is that ratio, so the chosen k's measured tokens per second beat plain decoding's or k is 0; a k not measured yet
keeps the cost model, its per-draft cost raised to the nearest measured k's (the model alone left out rollbacks,
replay steps and the speculative step's fixed costs: it priced an extra draft at 0.1-0.25 of a plain step where runs
said ~0.3, and chose k = 2-3 where k = 1 was faster).
Calibration: after `calibrate_every` speculative decode steps (the first after 8, then 32) of a bucket without a
plain one, at the first step where no replay is due, its auto requests are held plain for one step, so the plain
step time t0 is measured (the speculative step's fixed overhead, residual and snapshots, then counts in m rather
than hiding in t0); where that measurement says no k pays, they stay plain.
Kept across engines: the cost model, the whole steps and the calibration counts (`spec_costs.Kept`) live on the
model object (`kept_for`, by device, dtype and decode path), so an engine built over a model an earlier one
measured starts from those costs (a server keeps them anyway; a user building an engine per batch, as
benchmarks/spec_decode.py does, would otherwise pay the exploration every time: tiny config, batch 16, ~10 steps of
k = 1 at 0.9x plain). The first engine still pays it, and a k not run for `forget` decode steps (counted over all
of them) is priced by the cost model and tried again, measured anew. Acceptance stays per engine.
"""

from __future__ import annotations

import weakref

from flashnext.serve.spec_costs import Kept, bucket, expected_tokens, fast_down

K_MAX = 4  # auto's longest draft: E(k) gains little past it unless acceptance is very high


def choose_k(a, c: float, v: float, k_max: int, min_gain: float = 1.0) -> int:
    """The draft length in [0, k_max] maximising E(k) / (1 + k*(c + v)) (see the module doc; `a` one acceptance
    or per-position rates, as `expected_tokens`); 0 when no k > 0 beats plain decoding by `min_gain`. Ties
    (within 1e-9) go to the shorter draft."""
    return best_k(a, [1.0 + k * (c + v) for k in range(k_max + 1)], min_gain)


def best_k(a, ratios, min_gain: float = 1.0) -> int:
    """The draft length k in [0, len(ratios) - 1] maximising E(k) / ratios[k], where ratios[k] is the time of a
    step with k drafts over a plain step's (ratios[0] = 1); 0 when no k > 0 gains `min_gain`. Ties (within 1e-9)
    go to the shorter draft."""
    return pick_k([expected_tokens(a, k) / r for k, r in enumerate(ratios)], min_gain)


def pick_k(gains, min_gain: float = 1.0) -> int:
    """The k maximising gains[k] (gains[0] = 1, plain decoding); 0 unless it gains `min_gain`. Ties (within 1e-9)
    go to the shorter draft."""
    top = max(gains)
    best = next(k for k, g in enumerate(gains) if g >= top - 1e-9)  # gains within rounding of the top: shortest
    return best if gains[best] >= min_gain else 0


class AutoSpec:
    """Per-request draft lengths for `num_speculative_tokens="auto"` (see the module doc).

    Args:
        k_max: the longest draft.
        fixed: (c, v) cost ratios to use instead of measured ones (tests; v then does not grow with the batch).
        prior_rate: the engine-wide acceptance of every draft position before any verification.
        prior_c, prior_v: ratios used while a bucket is unmeasured (v per request of the batch; 0.005: whole
            k = 1 steps at batch 16 measured ~1.38 plain steps on the tiny and the deep configs, c + 16 v; the
            measured whole steps correct an optimistic start within a few steps).
        alpha, global_alpha: weight of one verified draft in a request's / the engine's acceptance.
        min_gain: the expected gain a draft must promise over plain decoding.
        probe_gain: the gain drafts certain to be accepted must promise at the batch's measured costs before a
            request that stepped aside probes again (or a queued request starts speculating).
        probe_every: plain steps of a request between probes (doubled after each probe that did not bring it back,
            up to `max_backoff` times).
        calibrate_every: speculative decode steps of a batch bucket before one plain step measures it again.
        min_samples: whole speculative steps with k drafts a bucket needs before their measured time prices k.
        forget: decode steps after a k's latest whole step before its measured time stops pricing it.
        kept: measurements to continue from and add to (`kept_for`: shared by the engines over one model); the
            first AutoSpec over an empty one sets its cost model's and whole steps' parameters.
    """

    def __init__(self, k_max: int = K_MAX, fixed: tuple[float, float] | None = None, prior_rate: float = 0.5,
                 prior_c: float = 0.3, prior_v: float = 0.005, alpha: float = 0.15, global_alpha: float = 0.02,
                 min_gain: float = 1.03, probe_every: int = 16, max_backoff: int = 8, decay: float = 0.98,
                 calibrate_every: int = 64, probe_gain: float = 1.2, min_samples: int = 3,
                 forget: int = 256, kept: Kept | None = None):  # fmt: skip
        self.k_max, self.fixed = k_max, fixed
        self.rate = [prior_rate] * max(1, k_max)  # engine-wide acceptance per draft position
        self.prior_c, self.prior_v = prior_c, prior_v
        self.alpha, self.global_alpha, self.min_gain = alpha, global_alpha, min_gain
        self.probe_every, self.max_backoff, self.decay = probe_every, max_backoff, decay
        self.calibrate_every, self.probe_gain = calibrate_every, probe_gain
        self.rates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> acceptance per position
        self.plain_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> steps since off
        self.probing: weakref.WeakSet = weakref.WeakSet()
        self.last_k: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> its latest choice
        self.ending: weakref.WeakSet = weakref.WeakSet()  # requests at their last token (no room for drafts)
        self.probes = 0  # one-draft probes of requests that had stepped aside
        self.backoff: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # request -> probe interval factor
        kept = (Kept() if kept is None else kept).start(decay, prior_c, prior_v, min_samples, forget)
        self.model, self.wholes = kept.model, kept.wholes
        self.since_plain, self.plain_count = kept.since_plain, kept.plain_count
        self.batch, self.batch_rates = 1, []  # and the running requests' mean acceptance per position (`before_step`)
        self.paused: weakref.WeakSet = weakref.WeakSet()  # requests held plain for one calibration step
        self._gains: tuple | None = None  # ((clock, batch, rates), ratios) of this step
        self._pending: tuple | None = None  # this step's (batch, k, requests, output lengths, most, drafted)

    # ---- acceptance --------------------------------------------------------------------------------------
    def observe(self, req, drafted: int, accepted: int) -> None:
        """One verify step of `req`: `accepted` of its `drafted` drafts (positions 0..accepted-1 succeeded, position
        `accepted` failed when it was drafted, the later ones were not tried)."""
        r = self.rates.get(req) or list(self.rate)
        trials = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for j, x in enumerate(trials[: len(r)]):
            r[j] += self.alpha * (x - r[j])
            self.rate[j] += self.global_alpha * (x - self.rate[j])
        self.rates[req] = r

    # ---- costs -------------------------------------------------------------------------------------------
    def record_plan(self, plan, seconds: float) -> None:
        """A model step over `plan` ((request, known tokens fed) entries, drafts not yet verified): recorded when
        every entry decodes (no prompt chunk): a plain step's time (no request speculating), or a speculative
        step's with the tokens fed beyond one per entry."""
        self._pending = None
        if not all(req.num_cached >= len(req.prompt_ids) for req, _ in plan):
            return
        self.wholes.clock += 1
        b = bucket(len(plan))
        # the step's k: drafts per entry, rounded, an entry without drafts counting its request's latest choice
        # (a replay after rejections, or a head restarting, is a cost of drafting k; a request's last step, with no
        # room for drafts, is not: counted for k it passed for a cheap k step and turned drafting off)
        mode = sum(len(r.drafts) or (self.last_k.get(r, 0) if r.spec_k and r not in self.ending else 0)
                   for r, _ in plan)  # fmt: skip
        k = int(mode / len(plan) + 0.5)
        plain = not any(req.spec_k for req, _ in plan)
        # a plain step prices plain decoding only when every entry feeds its one token: a replay after rejected
        # drafts takes the multi-token path (tiny config, batch 16: 1.3x a plain step, so drafts at a loss looked
        # like a gain)
        clean = all(n == 1 for _, n in plan)
        if k or (plain and clean):  # neither: a lone probe in a plain batch, or a plain step with replays
            reqs = [req for req, _ in plan]
            most = sum(len(req.drafts) + 1 for req in reqs)  # tokens were every draft accepted
            drafted = all(req.drafts for req in reqs)
            self._pending = (len(plan), k, reqs, sum(len(req.output_ids) for req in reqs), most, drafted)
        if plain:
            if clean:
                self.model.plain[b] = fast_down(self.model.plain.get(b), seconds)
                self.plain_count[b] = self.plain_count.get(b, 0) + 1
            self.since_plain[b] = 0
            return
        self.since_plain[b] = self.since_plain.get(b, 0) + 1
        self.model.record_step(len(plan), sum(n + len(req.drafts) for req, n in plan) - len(plan), seconds)

    def record_step_end(self, seconds: float) -> None:
        """The whole engine step `record_plan` saw (from its model step's start to the end of the proposal)."""
        if self._pending is not None:
            batch, k, reqs, before, most, drafted = self._pending
            self.record_whole(batch, k, seconds, sum(len(req.output_ids) for req in reqs) - before, most, drafted)
            self._pending = None

    def record_whole(self, batch: int, k: int, seconds: float, tokens: float, most: float = 0.0,
                     drafted: bool = True) -> None:  # fmt: skip
        """A whole decode-only step of `batch` entries in mode `k` (drafts per entry, rounded; 0: a plain step) that
        emitted `tokens` (`most` had every draft been accepted; `drafted`: every entry had drafts): what prices k
        against plain decoding (`gains`)."""
        self.wholes.record(batch, k, seconds, tokens, most, drafted)

    def gains(self, batch: int, rates=None, certain: bool = False) -> list[float]:
        """Per k in [0, k_max], tokens per second drafting k over plain decoding's, at this batch's bucket. Measured
        where k has `min_samples` whole steps and the bucket a plain one: (seconds per token plain) / (seconds per
        token in k's steps), rollbacks, replays, proposals and host work included; else E(k) / (1 + k (c + v)),
        the cost model's (`costs`, no dearer than the priors) with `rates` (default the engine's), its per-draft
        cost raised to that of the nearest measured k (ties: the shorter one; a measured k's step costs
        E(k) / gain(k) plain steps). `certain`: as if every draft were accepted (`rates` then all 1): a measured
        k's steps priced at k + 1 tokens per entry."""
        rates = self.rate if rates is None else rates
        c, v = self.fixed if self.fixed is not None else self.model.costs(batch)
        if self.fixed is None:  # the model no dearer than the priors: a line fit to a few steps in a burst of load
            c, v = min(c + v, self.prior_c + self.prior_v * batch), 0.0  # would keep drafting off from the start
        model = [expected_tokens(rates, k) / (1.0 + k * (c + v)) for k in range(self.k_max + 1)]
        if self.fixed is not None:
            return model
        measured = self.wholes.gains(bucket(batch), self.k_max, certain)
        if not measured:  # nothing here yet: no cheaper a draft than the nearest measured bucket's
            per = self.wholes.borrowed(bucket(batch), rates)
            return model if per is None else [expected_tokens(rates, k) / (1.0 + k * max(c + v, per))
                                              for k in range(self.k_max + 1)]  # fmt: skip
        out = [1.0]
        for k in range(1, self.k_max + 1):
            if k in measured:
                out.append(measured[k])
                continue
            near = min(measured, key=lambda j: (abs(j - k), j), default=None)
            per = (expected_tokens(rates, near) / measured[near] - 1.0) / near if near is not None else 0.0
            out.append(expected_tokens(rates, k) / (1.0 + k * max(c + v, per)))
        return out

    def record_proposal(self, batch: int, cells, seconds: float) -> None:
        """A proposal after a step of `batch` entries (`cells`: (request, entry) pairs): as many draft steps as
        its longest draft (the head's cell step is the first)."""
        longest = max((len(req.drafts) for req, _ in cells), default=0)
        if longest:  # a proposal of head cells alone (a prompt chunk's) says little of a draft step's cost
            self.model.record_drafts(batch, longest, seconds)

    def measured(self, batch: int) -> bool:
        """Whether `gains(batch)` come from measurements (or `fixed`), not the priors."""
        b = bucket(batch)
        return self.fixed is not None or self.wholes.any_fresh(b) or self.model.measured(b)

    # ---- the choice ----------------------------------------------------------------------------------------
    def draft_count(self, req, cap: int) -> int:
        """Drafts for `req`'s next step, at most `cap` (the speculator's limit); 0 sends it plain (`spec_k` 0)."""
        if req in self.probing:
            self.probing.discard(req)
            self.probes += 1
            return min(1, cap)
        k = min(cap, self._choice(req))
        self.last_k[req] = k
        if k > 0:
            self.backoff.pop(req, None)
        elif cap > 0:
            req.spec_k, req.drafts = 0, []
            self.plain_steps[req] = 0
            if req in self.backoff:  # a probe that did not bring it back: wait twice as long for the next one
                self.backoff[req] = min(self.backoff[req] * 2, self.max_backoff)
            else:
                self.backoff[req] = 1
        return k

    def _choice(self, req) -> int:
        """The k that pays best for `req` now (0: none pays `min_gain`). Past batch 1 every auto request of the step
        drafts the same k, from the batch's mean rates: entries of unequal lengths leave the verify step's
        equal-length paths (batch 16, deep config: mixed 1- and 2-draft entries took ~1.7x 1-draft ones)."""
        rates = self.rates.get(req, self.rate) if self.batch == 1 or not self.batch_rates else self.batch_rates
        key = (self.wholes.clock, self.batch, tuple(rates))
        if self._gains is None or self._gains[0] != key:  # once a step past batch 1, not per request
            self._gains = (key, self.gains(self.batch, rates))
        return pick_k(self._gains[1], self.min_gain)

    def before_step(self, running, waiting=(), max_slots: int | None = None) -> None:
        """Count the plain steps of requests that stepped aside; re-arm those due for a probe (every
        `probe_every` steps, doubling after each probe that did not bring the request back, up to `max_backoff`
        times; none while even drafts certain to be accepted would not gain `probe_gain` at this batch).
        Queued requests not started yet start plain when the measured costs of the batch they will join say the
        same (no head cells for their prompts)."""
        self.batch = max(1, len(running))
        if self.batch > 1:  # per draft position, the mean over the running requests' rates (`draft_count`)
            each = [self.rates.get(req, self.rate) for req in running]
            self.batch_rates = [sum(r[j] for r in each) / len(each) for j in range(len(self.rate))]
        if waiting:
            joined = min(max_slots or len(running) + len(waiting), len(running) + len(waiting))
            if self.measured(joined) and not self._could_pay(joined):
                for parent in waiting:
                    for req in parent.choices or [parent]:
                        if req.spec_k and req.num_cached == 0 and req.params.num_speculative_tokens is None:
                            req.spec_k, self.plain_steps[req], self.backoff[req] = 0, 0, 1
        self._calibrate(running)
        could_pay = None
        for req in running:
            n = self.plain_steps.get(req)
            if n is None or req.finished:
                continue
            if n + 1 < self.probe_every * self.backoff.get(req, 1):
                self.plain_steps[req] = n + 1
                continue
            if could_pay is None:
                could_pay = self._could_pay(self.batch)
            if not could_pay:
                self.plain_steps[req] = 0
                continue
            del self.plain_steps[req]
            self.probing.add(req)
            req.spec_k, req.mtp_cells, req.resume_residual = self.k_max, req.num_cached, None

    def _could_pay(self, batch: int) -> bool:
        """Whether drafts certain to be accepted would gain `probe_gain` at this batch's costs."""
        return pick_k(self.gains(batch, [1.0] * self.k_max, True), max(self.min_gain, self.probe_gain)) > 0

    def _calibrate(self, running) -> None:
        """Re-arm the requests paused last step (where a k still pays: else they stay plain, as `draft_count` would
        send them after a step restarting their head); when this batch's bucket has had `calibrate_every`
        speculative decode steps without a plain one (8 after none measured, then 32, 128, ...: each calibration
        costs the paused step and the step after, whose head restarts without drafts), pause its speculating
        requests for one step, the first where none is due a replay (a plain step to measure against: without it a
        speculative step's fixed overhead would pass for plain cost)."""
        paused = [req for req in self.paused if not req.finished and req.spec_k == 0]
        self.paused.clear()
        for req in paused:
            if self._choice(req) > 0:
                req.spec_k, req.mtp_cells, req.resume_residual = self.k_max, req.num_cached, None
            else:  # the plain step just measured says no k pays: stay plain (no step restarting the head for it)
                self.last_k[req], self.plain_steps[req], self.backoff[req] = 0, 0, 1
        b = bucket(self.batch)
        due = min(self.calibrate_every, 8 << min(2 * self.plain_count.get(b, 0), 8))  # 8, 32, 128, ... steps
        if self.fixed is not None or self.since_plain.get(b, 0) < due:
            return
        if any(len(req.prompt_ids) + len(req.output_ids) - req.num_cached != 1 for req in running):
            return  # a replay is due: the plain step would not measure plain decoding (`record_plan`); next step
        self.since_plain[b] = 0
        for req in running:
            if (
                req.spec_k
                and not req.finished
                and req.params.num_speculative_tokens is None
                and req not in self.probing
            ):
                req.spec_k, req.drafts = 0, []
                self.paused.add(req)


def is_auto(k) -> bool:
    """`num_speculative_tokens="auto"` (any case)."""
    return isinstance(k, str) and k.strip().lower() == "auto"
