"""What `serve.spec_auto` measures to price draft lengths: per batch bucket, the cost model's step-time line and draft
time (`CostModel`), the whole decode-only engine steps per draft length (`WholeSteps`, `Times`), and `Kept`, the
measurements an engine continues from (`kept_for`: per model, across engines). The module doc of
`serve.spec_auto` says how they are used."""

from __future__ import annotations

import collections
import math
import weakref


def expected_tokens(a, k: int) -> float:
    """Tokens a verify step with k drafts emits on average. `a`: one acceptance for every draft position
    (sum_{i=0..k} a^i), or per-position rates a[j] (draft j+1 accepted given the ones before it were:
    1 + a[0] + a[0] a[1] + ...; positions past the list take its last rate)."""
    rates = [float(a)] if isinstance(a, (int, float)) else [float(x) for x in a]
    total, term = 1.0, 1.0
    for j in range(k):
        term *= rates[min(j, len(rates) - 1)]
        total += term
    return total


def bucket(batch: int) -> int:
    """The power of two at or above `batch` (costs are kept per bucket)."""
    return 1 << max(0, batch - 1).bit_length()


class Line:
    """Decayed least squares of step seconds against extra fed tokens: (t0, m) once two distinct x were seen."""

    def __init__(self, decay: float):
        self.decay = decay
        self.s = [0.0] * 5  # n, sum x, sum y, sum xx, sum xy

    def add(self, x: float, y: float) -> None:
        d = self.decay
        n, sx, sy, sxx, sxy = (v * d for v in self.s)
        self.s = [n + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]

    def fit(self) -> tuple[float, float] | None:
        n, sx, sy, sxx, sxy = self.s
        det = n * sxx - sx * sx
        if n < 2 or det <= 1e-9 * max(1.0, n * sxx):
            return None
        m = max(0.0, (n * sxy - sx * sy) / det)
        t0 = (sy - m * sx) / n
        return (t0, m) if t0 > 0 else None

    def mean(self) -> tuple[float, float] | None:
        n, sx, sy = self.s[:3]
        return (sx / n, sy / n) if n else None


class Times:
    """Whole steps of one (bucket, k): the low envelope of the times of those where every entry drafted
    (`fast_down`), the latest `keep` (seconds, tokens emitted, tokens had every draft been accepted) samples, the
    sample count and the decode step (`AutoSpec`'s clock) of the latest.
    `per_token()` is seconds per emitted token over the kept samples within `burst` times the envelope: a step's own
    variation (a replay after a rejection, a head restarting without drafts) counts, a burst of load on a shared
    machine (2-3x a few steps in a row) does not. (An envelope of all of k's steps was that of the cheap steps
    without drafts: tiny config, batch 16, the steps with drafts took 1.5x them, fell outside and k = 1 at 0.9x
    plain measured 1.05x.)"""

    def __init__(self, keep: int = 16, burst: float = 1.5):
        self.low, self.n, self.last, self.burst = None, 0, 0, burst
        self.recent: collections.deque = collections.deque(maxlen=keep)

    def add(self, seconds: float, tokens: float, clock: int, most: float = 0.0, drafted: bool = True) -> None:
        self.low = fast_down(self.low, seconds) if drafted else self.low
        self.n, self.last = self.n + 1, clock
        self.recent.append((seconds, tokens, max(most, tokens)))

    def per_token(self, certain: bool = False) -> float:
        """Seconds per emitted token (`certain`: per token had every draft been accepted)."""
        top = math.inf if self.low is None else self.burst * self.low
        kept = [(s, m if certain else t) for s, t, m in self.recent if s <= top]
        return sum(s for s, _ in kept) / max(1e-9, sum(t for _, t in kept))


def fast_down(old: float | None, seconds: float) -> float:
    """Fast down, slow up: on a shared machine timing noise only adds time, so a faster plain step is taken at once
    and a slower one averaged in (one slow early sample would otherwise pass for the plain cost until the next
    calibration, making every draft look cheap)."""
    old = seconds if old is None else old
    return min(seconds, old + 0.1 * (seconds - old))


class CostModel:
    """The cost model (module doc) that prices k before whole steps are measured: per batch bucket a decayed
    least-squares line of a speculative step's time in the tokens fed beyond one per request, the draft step's time
    and the plain step's time (`AutoSpec.fixed` ratios replace it in tests)."""

    def __init__(self, decay: float, prior_c: float, prior_v: float):
        self.decay, self.prior_c, self.prior_v = decay, prior_c, prior_v
        self.steps: dict[int, Line] = {}
        self.draft: dict[int, float] = {}  # bucket -> seconds per draft step (exponential average)
        self.plain: dict[int, float] = {}  # bucket -> seconds of a plain decode step (fast down, slow up)

    def record_step(self, batch: int, extra_tokens: int, seconds: float) -> None:
        """A decode-only model step of `batch` requests that fed `extra_tokens` beyond one each."""
        self.steps.setdefault(bucket(batch), Line(self.decay)).add(extra_tokens, seconds)

    def record_drafts(self, batch: int, draft_steps: int, seconds: float) -> None:
        """A proposal (head cells, then chained draft steps) of `draft_steps` drafts for `batch` requests."""
        b, per = bucket(batch), seconds / max(1, draft_steps)
        self.draft[b] = per if b not in self.draft else self.draft[b] + 0.2 * (per - self.draft[b])

    def measured(self, b: int) -> bool:
        line = self.steps.get(b)
        return line is not None and b in self.draft and (b in self.plain or line.fit() is not None)

    def costs(self, batch: int) -> tuple[float, float]:
        """(c, v) at this batch size: measured where the bucket has them, else the priors. The plain step's time
        t0 is the measured plain step's when there is one (the speculative step's fixed overhead then counts in
        the per-token cost m, averaged over the tokens fed), else the line's intercept."""
        b = bucket(batch)
        line = self.steps.get(b)
        mean = line.mean() if line is not None else None
        if mean is None or b not in self.draft:
            return self.prior_c, self.prior_v * batch
        x, y = mean
        fit = line.fit()
        if b in self.plain:
            t0 = self.plain[b]
            m = max(fit[1] if fit else 0.0, (y - t0) / x if x > 0 else 0.0)
        elif fit is not None:
            t0, m = fit
        else:  # t0 from the prior marginal cost: y = t0 * (1 + prior_v * x)
            t0 = y / (1.0 + self.prior_v * x)
            return self.draft[b] / t0, self.prior_v * batch
        return self.draft[b] / t0, batch * m / t0


class WholeSteps:
    """Whole decode-only engine steps (model step, sampling or verification, rollback, proposal), what prices k
    against plain decoding (`AutoSpec.gains`): per (bucket, drafts per entry) their seconds and emitted tokens, per
    bucket plain decoding's seconds per token (fast down, slow up). `clock` counts decode-only steps; a k's
    measurement prices it while `fresh`."""

    def __init__(self, min_samples: int, forget: int):
        self.min_samples, self.forget = min_samples, forget
        self.steps: dict[tuple[int, int], Times] = {}  # (bucket, drafts per entry) -> (seconds, tokens) per step
        self.plain: dict[int, float] = {}  # bucket -> seconds per token of plain steps
        self.clock = 0

    def record(self, batch: int, k: int, seconds: float, tokens: float, most: float = 0.0, drafted: bool = True):
        b = bucket(batch)
        if k == 0:
            self.plain[b] = fast_down(self.plain.get(b), seconds / batch)  # one token per entry
        else:
            times = self.steps.get((b, k))
            if times is None or self.clock - times.last > self.forget:  # stale: measured anew, on the text of now
                times = self.steps[b, k] = Times()
            times.add(seconds, tokens, self.clock, most, drafted)

    def fresh(self, low: Times | None) -> bool:
        """Whether a k's whole-step time prices it: `min_samples` samples, the latest within `forget` decode steps
        (a k left for long is priced by the model again, so a cost measured under a burst of load is retried; its
        steps then start over (`record`): one retried step had revived the stale ones beside it)."""
        return low is not None and low.n >= self.min_samples and self.clock - low.last <= self.forget

    def gains(self, b: int, k_max: int, certain: bool = False) -> dict[int, float]:
        """{k: plain seconds per token / k's seconds per token} for the fresh k of bucket `b` (`certain`: had every
        draft of its steps been accepted)."""
        plain = self.plain.get(b)
        return {k: plain / self.steps[b, k].per_token(certain) for k in range(1, k_max + 1)
                if plain is not None and self.fresh(self.steps.get((b, k)))}  # fmt: skip

    def any_fresh(self, b: int) -> bool:
        return b in self.plain and any(self.fresh(m) for (wb, _), m in self.steps.items() if wb == b)

    def borrowed(self, b: int, rates) -> float | None:
        """The per-draft cost (in plain steps) measured at the bucket nearest `b` that has a fresh k (its shortest),
        or None: a bucket a batch enters late (requests finishing at different steps) starts from it, not from the
        priors (they had the tail of a batch-16 run drafting k = 2-3 where k = 1 barely paid)."""
        near = sorted((abs(math.log2(wb / b)), wb, k) for (wb, k), m in self.steps.items()
                      if wb != b and wb in self.plain and self.fresh(m))  # fmt: skip
        if not near:
            return None
        _, wb, k = near[0]
        gain = self.plain[wb] / self.steps[wb, k].per_token()
        return (expected_tokens(rates, k) / gain - 1.0) / k


class Kept:
    """The cost measurements of `AutoSpec` (its cost model, whole steps, calibration counts), kept per model across
    engines by `kept_for`; a fresh one (the default) starts from the priors."""

    def __init__(self):
        self.model: CostModel | None = None
        self.wholes: WholeSteps | None = None
        self.since_plain: dict[int, int] = {}  # bucket -> speculative decode steps since its last plain one
        self.plain_count: dict[int, int] = {}  # bucket -> plain decode steps measured

    def start(self, decay: float, prior_c: float, prior_v: float, min_samples: int, forget: int) -> Kept:
        """Itself, its cost model and whole steps made with these parameters if it has none yet (a first engine)."""
        if self.model is None:
            self.model, self.wholes = CostModel(decay, prior_c, prior_v), WholeSteps(min_samples, forget)
        return self


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {costs key: Kept}


def kept_for(model, key) -> Kept:
    """The measurements kept for `model` under `key` (what makes step costs comparable: device, dtype, compiled
    decode step or not, weights frozen into it or not): every auto engine built over the same model object in this
    process shares them, so a second engine starts from what the first measured; dropped with the model."""
    return _KEPT.setdefault(model, {}).setdefault(key, Kept())
