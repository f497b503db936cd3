"""Engine counters, recent rates and latency windows, and their Prometheus exposition (`/metrics`)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque


class EngineStats:
    """Counters for /metrics and the server's logs.

    Written by the engine thread; read by others (`recent_rates`, the exposition), hence the lock around the
    rate window. Counters are plain ints (a torn read of an int cannot happen).

    Args:
        window: latency samples kept (TTFT, TPOT of the most recent finished requests).
        rate_seconds: span of the recent-rate window (`recent_rates`).
    """

    def __init__(self, window: int = 1000, rate_seconds: float = 10.0):
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
    return "\n".join(lines) + "\n"
