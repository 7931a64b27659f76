"""The engine's figures: what a server exposes and the periodic log line prints."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

_SAMPLES = 10_000  # latency samples kept for percentiles


def _percentile(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class Histogram:
    """Cumulative bucket counts, as Prometheus exposes them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        total, out = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            out.append((bound, total))
        return out


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    queue_wait_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    ttft_histogram: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl_histogram: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_histogram: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    finished_by_reason: dict = field(default_factory=dict)

    def on_scheduled(self, request, now: float) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            self.queue_wait_s.append(now - request.arrival_time)
            self.prompt_tokens += len(request.prompt_token_ids)

    def on_token(self, request, now: float) -> None:
        self.generation_tokens += 1
        if request.last_token_time is None:
            self.ttft_s.append(now - request.arrival_time)
            self.ttft_histogram.observe(now - request.arrival_time)
        else:
            self.itl_s.append(now - request.last_token_time)
            self.itl_histogram.observe(now - request.last_token_time)
        request.last_token_time = now

    def on_finished(self, request, now: float) -> None:
        self.finished_requests += 1
        reason = request.finish_reason
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        self.e2e_histogram.observe(now - request.arrival_time)

    def summary(self) -> dict:
        return {
            "ttft_p50_s": _percentile(self.ttft_s, 0.5), "ttft_p99_s": _percentile(self.ttft_s, 0.99),
            "itl_p50_s": _percentile(self.itl_s, 0.5), "itl_p99_s": _percentile(self.itl_s, 0.99),
            "queue_wait_p50_s": _percentile(self.queue_wait_s, 0.5),
            "queue_wait_p99_s": _percentile(self.queue_wait_s, 0.99),
        }


def now() -> float:
    return time.monotonic()
