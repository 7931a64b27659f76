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


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    itl_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    queue_wait_s: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def on_scheduled(self, request, now: float) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            self.queue_wait_s.append(now - request.arrival_time)
            self.prompt_tokens += len(request.prompt_token_ids)

    def on_token(self, request, now: float) -> None:
        self.generation_tokens += 1
        if request.last_token_time is None:
            self.ttft_s.append(now - request.arrival_time)
        else:
            self.itl_s.append(now - request.last_token_time)
        request.last_token_time = now

    def summary(self) -> dict:
        return {
            "ttft_p50_s": _percentile(self.ttft_s, 0.5), "ttft_p99_s": _percentile(self.ttft_s, 0.99),
            "itl_p50_s": _percentile(self.itl_s, 0.5), "itl_p99_s": _percentile(self.itl_s, 0.99),
            "queue_wait_p50_s": _percentile(self.queue_wait_s, 0.5),
            "queue_wait_p99_s": _percentile(self.queue_wait_s, 0.99),
        }


def now() -> float:
    return time.monotonic()
