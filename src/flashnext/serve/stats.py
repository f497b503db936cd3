"""Engine counters, recent rates and latency windows, and their Prometheus exposition (`/metrics`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque

from flashnext.serve.prefix_cache import prometheus_lines

log = logging.getLogger("flashnext.serve")

# Below this share of accepted drafts, speculation is a loss. A verify step with k drafts yields 1 + a*k tokens
# (a: acceptance) and costs a decode step plus, per draft, its share of the verify step and one head step: ~0.5 of
# a decode step per draft for the tiny model on CPU (benchmarks/RESULTS.md, benchmarks/spec_decode.py), so k = 3
# breaks even near a = 0.5 there; a large model on a GPU (head ~2% of the model) breaks even at a few percent. An
# untrained head drafts at chance (the tiny SFT model trained without the MTP loss: 1.5% at k = 3, 4% at k = 1 on
# held-out prompts), a trained one far above (configs/tiny-sft.toml: 34% at k = 3, 53% at k = 1; a per-position
# acceptance of 0.55 still gives 15% at k = 8). 0.1 tells the two apart and is below the tiny model's break-even.
LOW_ACCEPTANCE = 0.1
ACCEPTANCE_WINDOW = 256  # drafts per acceptance check: enough that one unlucky request does not decide it


class EngineStats:
    """Counters for /metrics and the server's logs.

    Written by the engine thread; read by others (`recent_rates`, the exposition), hence the lock around the
    rate window. Counters are plain ints (a torn read of an int cannot happen).

    Args:
        window: latency samples kept (TTFT, TPOT of the most recent finished requests).
        rate_seconds: span of the recent-rate window (`recent_rates`).
        low_acceptance: the draft acceptance rate below which speculation costs more than it saves; the first
            `acceptance_window` drafts (counted in consecutive windows) accepted below it log one warning.
        acceptance_window: drafts per acceptance check.
    """

    def __init__(self, window: int = 1000, rate_seconds: float = 10.0, low_acceptance: float = LOW_ACCEPTANCE,
                 acceptance_window: int = ACCEPTANCE_WINDOW):  # fmt: skip
        self.rate_seconds = rate_seconds
        self.prompt_tokens = 0  # prompt tokens prefilled (once per prompt: n choices share it)
        self.generated_tokens = 0
        self.recomputed_tokens = 0  # tokens fed again after a failed step
        self.steps = 0
        self.failed_steps = 0
        self.step_seconds = 0.0
        self.finished = 0
        self.finish_reasons: Counter[str] = Counter()
        self.ttft: deque[float] = deque(maxlen=window)
        self.tpot: deque[float] = deque(maxlen=window)
        # Speculative decoding: drafts verified and accepted, verify steps (one per request and step), tokens fed
        # again after a rejection; per finished request that speculated, its acceptance rate and mean length.
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_verify_steps = 0
        self.spec_replayed_tokens = 0
        self.spec_request_acceptance: deque[float] = deque(maxlen=window)
        self.spec_request_length: deque[float] = deque(maxlen=window)
        self.low_acceptance, self.acceptance_window = low_acceptance, acceptance_window
        self.low_acceptance_warned = False  # once per engine (per server run)
        self._window_drafted = self._window_accepted = 0
        self._recent: deque[tuple[float, int, int]] = deque()  # (end time, prompt tokens, sampled tokens)
        self._lock = threading.Lock()

    def step(self, prompt_tokens: int, seconds: float, sampled: int, recomputed: int = 0) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.step_seconds += seconds
        self.generated_tokens += sampled
        self.prompt_tokens += prompt_tokens
        self.recomputed_tokens += recomputed
        with self._lock:
            self._recent.append((now, prompt_tokens, sampled))
            while self._recent[0][0] < now - self.rate_seconds:
                self._recent.popleft()

    def speculation(self, drafted: int, accepted: int, replay: int) -> None:
        """One request's verify step: `drafted` drafts, `accepted` of them, `replay` tokens to feed again."""
        self.spec_drafted += drafted
        self.spec_accepted += accepted
        self.spec_verify_steps += 1
        self.spec_replayed_tokens += replay
        if not self.low_acceptance_warned:
            self._check_acceptance(drafted, accepted)

    def _check_acceptance(self, drafted: int, accepted: int) -> None:
        """Warn once when a full window of drafts was accepted below `low_acceptance` (drafting then slows the
        requests down: an untrained MTP head)."""
        self._window_drafted += drafted
        self._window_accepted += accepted
        if self._window_drafted < self.acceptance_window:
            return
        n, rate = self._window_drafted, self._window_accepted / self._window_drafted
        self._window_drafted = self._window_accepted = 0
        if rate < self.low_acceptance:
            self.low_acceptance_warned = True
            log.warning(
                "speculative decoding: %.1f%% of the last %d draft tokens were accepted, below %.0f%%, where drafting "
                "costs more than it saves (the MTP head is likely untrained): serve with --speculative-tokens 0, or "
                "train the head (flashnext train --train.mtp_loss_weight=W; configs/tiny-sft.toml uses 0.1)",
                100 * rate, n, 100 * self.low_acceptance,
            )  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens, server-wide (NaN before any)."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's one), server-wide (NaN before any)."""
        steps = self.spec_verify_steps
        return (self.spec_accepted + steps) / steps if steps else float("nan")

    def recent_rates(self, now: float | None = None) -> tuple[float, float]:
        """(prompt tokens/s, generated tokens/s) over the last `rate_seconds` (0 when idle that long)."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            recent = [r for r in self._recent if r[0] >= now - self.rate_seconds]
        return sum(r[1] for r in recent) / self.rate_seconds, sum(r[2] for r in recent) / self.rate_seconds

    def finish(self, req) -> None:
        self.finished += 1
        self.finish_reasons[req.finish_reason] += 1
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival)
            n = len(req.output_ids)
            if n > 1 and req.finish_time is not None:
                self.tpot.append((req.finish_time - req.first_token_time) / (n - 1))
        if req.num_drafted:
            self.spec_request_acceptance.append(req.num_accepted / req.num_drafted)
            self.spec_request_length.append((req.num_accepted + req.num_verify_steps) / req.num_verify_steps)


def _quantiles(name: str, values) -> list[str]:
    vals = sorted(values)
    lines = [f"# TYPE {name} summary"]
    for q in (0.5, 0.9, 0.99):
        v = vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")
        lines.append(f'{name}{{quantile="{q}"}} {v:.6f}')
    return lines + [f"{name}_sum {sum(vals):.6f}", f"{name}_count {len(vals)}"]


def prometheus_text(engine) -> str:
    """Prometheus exposition of the engine's counters, recent rates and latency summaries."""
    s = engine.stats
    prompt_rate, gen_rate = s.recent_rates()
    window = f"{s.rate_seconds:g}"
    lines = [
        "# TYPE flashnext_requests_running gauge",
        f"flashnext_requests_running {len(engine.running)}",
        "# TYPE flashnext_requests_waiting gauge",
        f"flashnext_requests_waiting {len(engine.waiting)}",
        "# TYPE flashnext_requests_finished_total counter",
        f"flashnext_requests_finished_total {s.finished}",
        "# HELP flashnext_requests_finished_by_reason_total finished requests (choices) by finish reason",
        "# TYPE flashnext_requests_finished_by_reason_total counter",
        *(
            f'flashnext_requests_finished_by_reason_total{{finish_reason="{r}"}} {s.finish_reasons[r]}'
            for r in ("length", "stop", "abort", "error")
        ),
        "# TYPE flashnext_prompt_tokens_total counter",
        f"flashnext_prompt_tokens_total {s.prompt_tokens}",
        "# TYPE flashnext_generation_tokens_total counter",
        f"flashnext_generation_tokens_total {s.generated_tokens}",
        "# HELP flashnext_recomputed_tokens_total tokens fed again to recover from failed steps",
        "# TYPE flashnext_recomputed_tokens_total counter",
        f"flashnext_recomputed_tokens_total {s.recomputed_tokens}",
        "# TYPE flashnext_step_failures_total counter",
        f"flashnext_step_failures_total {s.failed_steps}",
        f"# HELP flashnext_generation_tokens_per_second tokens generated per second over the last {window} s",
        "# TYPE flashnext_generation_tokens_per_second gauge",
        f"flashnext_generation_tokens_per_second {gen_rate:.3f}",
        f"# HELP flashnext_prompt_tokens_per_second prompt tokens prefilled per second over the last {window} s",
        "# TYPE flashnext_prompt_tokens_per_second gauge",
        f"flashnext_prompt_tokens_per_second {prompt_rate:.3f}",
        "# TYPE flashnext_cache_free_slots gauge",
        f"flashnext_cache_free_slots {engine.cache.free_slots}",
    ]
    lines += _quantiles("flashnext_time_to_first_token_seconds", s.ttft)
    lines += _quantiles("flashnext_time_per_output_token_seconds", s.tpot)
    lines += prometheus_lines(getattr(engine, "prefix_cache", None))
    return "\n".join(lines + _speculation_lines(s)) + "\n"


def _speculation_lines(s: EngineStats) -> list[str]:
    """Speculative decoding: server-wide counters and rates, and per-request summaries (finished requests)."""
    lines = [
        "# HELP flashnext_spec_draft_tokens_total MTP draft tokens verified",
        "# TYPE flashnext_spec_draft_tokens_total counter",
        f"flashnext_spec_draft_tokens_total {s.spec_drafted}",
        "# TYPE flashnext_spec_accepted_tokens_total counter",
        f"flashnext_spec_accepted_tokens_total {s.spec_accepted}",
        "# HELP flashnext_spec_verify_steps_total verify steps (one per speculating request and model step)",
        "# TYPE flashnext_spec_verify_steps_total counter",
        f"flashnext_spec_verify_steps_total {s.spec_verify_steps}",
        "# HELP flashnext_spec_replayed_tokens_total tokens fed again after rejected drafts (the rollback)",
        "# TYPE flashnext_spec_replayed_tokens_total counter",
        f"flashnext_spec_replayed_tokens_total {s.spec_replayed_tokens}",
    ]
    if s.spec_verify_steps:  # rates of nothing are not NaN samples: the gauges appear with the first verify step
        lines += [
            "# HELP flashnext_spec_acceptance_rate accepted / verified draft tokens",
            "# TYPE flashnext_spec_acceptance_rate gauge",
            f"flashnext_spec_acceptance_rate {s.acceptance_rate:.6f}",
            "# HELP flashnext_spec_mean_accepted_length tokens emitted per verify step (accepted drafts + 1)",
            "# TYPE flashnext_spec_mean_accepted_length gauge",
            f"flashnext_spec_mean_accepted_length {s.mean_accepted_length:.6f}",
        ]
    lines += _quantiles("flashnext_spec_request_acceptance_rate", s.spec_request_acceptance)
    return lines + _quantiles("flashnext_spec_request_mean_accepted_length", s.spec_request_length)
