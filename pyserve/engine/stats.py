"""The engine's figures: what /metrics exposes and the periodic log line prints.

Kept as vLLM v1 keeps them (vllm/v1/metrics/stats.py), so that its dashboards read ours the same
way. Each request's intervals, from its own timestamps (monotonic seconds):

    queue      arrival -> first scheduled
    prefill    first scheduled -> first token
    decode     first token -> last token
    inference  first scheduled -> last token
    e2e        arrival -> finish

A preemption stays inside the interval it falls in (only the first scheduling starts prefill).
Time to first token is arrival -> first token; inter-token latency the gap between a request's
consecutive tokens. A request's prompt tokens are counted when its first token comes (its
prefill is done), once, preemptions or not. Each finished completion is one finished request;
n and the longest completion are observed once the last of a request's n completions is done.
A request the client aborts is not counted as finished and adds to no per-request histogram
(vLLM's front end drops it without stats); the tokens it was given still count."""

from __future__ import annotations

import time
from array import array
from collections import Counter

from prometheus_client.utils import floatToGoString

_SAMPLES = 10_000  # latency samples kept for percentiles

# vLLM's bucket lists (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # also the per-request time per output token
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

# vLLM's finish reasons (vllm/v1/engine FINISH_REASON_STRINGS); pyserve's engine ends requests
# with the first three; each has its series from the start, zero or not
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets(max_model_len))."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def _percentile(values, q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class SampleWindow:
    """The last `size` samples (floats), for percentiles, in memory taken once at the start: a
    deque of floats grows by a float object and a slot per sample until it is full (10,000
    samples of time to first token are about 10,000 requests, a soak's whole run), which
    reads as a leak in the server's resident memory."""

    def __init__(self, size: int = _SAMPLES):
        self._values = array("d", bytes(8 * size))
        self._next = 0  # where the next sample goes
        self._count = 0

    def append(self, value: float) -> None:
        self._values[self._next] = value
        self._next = (self._next + 1) % len(self._values)
        self._count = min(self._count + 1, len(self._values))

    def __len__(self) -> int:
        return self._count

    def __iter__(self):
        return iter(self._values[:self._count])  # the samples, in no promised order


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

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count) pairs, le written as prometheus_client writes a float bound ("1.0",
        "2560.0", "+Inf"), so that ours and vLLM's series carry the same label values."""
        total, out = 0, []
        for bound, count in zip((*(floatToGoString(float(b)) for b in self.bounds), "+Inf"),
                                self.counts):
            total += count
            out.append((bound, total))
        return out


class EngineStats:
    def __init__(self, max_model_len: int):
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0  # of which the prefix cache served
        self.generation_tokens = 0
        self.finished_requests = 0
        self.finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        # speculative decoding (vLLM's spec_decode_* counters)
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_position: Counter = Counter()
        self._step_tokens = 0  # this step's prompt (prefills done) and generated tokens
        self.ttft_s = SampleWindow()
        self.itl_s = SampleWindow()
        self.queue_wait_s = SampleWindow()

        tokens = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = Histogram(ITL_BUCKETS)  # per request, decode only
        self.prompt_len = Histogram(tokens)
        self.generation_len = Histogram(tokens)
        self.prefill_computed = Histogram(tokens)  # prompt tokens not served by the cache
        self.max_tokens = Histogram(tokens)
        self.max_generation_len = Histogram(tokens)  # per request: its longest completion
        self.n = Histogram(N_BUCKETS)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)

    def on_scheduled(self, request, now: float) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
            self.queue_wait_s.append(now - request.arrival_time)

    def on_token(self, request, now: float) -> None:
        self.generation_tokens += 1
        self._step_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
            prompt = len(request.prompt_token_ids)
            self.prompt_tokens += prompt
            self.prompt_tokens_cached += request.num_cached_tokens
            self._step_tokens += prompt
            self.ttft_s.append(now - request.arrival_time)
            self.ttft.observe(now - request.arrival_time)
        else:
            self.itl_s.append(now - request.last_token_time)
            self.itl.observe(now - request.last_token_time)
        request.last_token_time = now

    def on_finished(self, request, now: float) -> None:
        """A completion the engine ended (stop or length) after its first token."""
        self.finished_requests += 1
        self.finished_by_reason[request.finish_reason] += 1
        scheduled, first, last = (request.first_scheduled_time, request.first_token_time,
                                  request.last_token_time)
        generated, prompt = len(request.output_token_ids), len(request.prompt_token_ids)
        self.e2e.observe(now - request.arrival_time)
        self.queue_time.observe(scheduled - request.arrival_time)
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(last - first)
        self.inference_time.observe(last - scheduled)
        # the first token belongs to the prefill; a one-token request observes 0, as vLLM's
        self.time_per_output_token.observe((last - first) / (generated - 1) if generated > 1 else 0.0)
        self.prompt_len.observe(prompt)
        self.generation_len.observe(generated)
        self.prefill_computed.observe(prompt - request.num_cached_tokens)
        self.max_tokens.observe(request.max_tokens)

    def on_pooled(self, request, now: float) -> None:
        """A pooling request computed its prompt (it generates nothing)."""
        prompt = len(request.prompt_token_ids)
        self.prompt_tokens += prompt
        self.prompt_tokens_cached += request.num_cached_tokens
        self._step_tokens += prompt
        self.e2e.observe(now - request.arrival_time)

    def on_speculated(self, num_drafts: int, num_accepted: int) -> None:
        """A verified step of one request: num_drafts proposed, num_accepted of them kept."""
        self.spec_drafts += 1
        self.spec_draft_tokens += num_drafts
        self.spec_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.spec_accepted_per_position[position] += 1

    def on_group_finished(self, children) -> None:
        """The last of a request's n completions is done."""
        self.n.observe(len(children))
        self.max_generation_len.observe(max(len(c.output_token_ids) for c in children))

    def on_step_done(self) -> None:
        if self._step_tokens:
            self.iteration_tokens.observe(self._step_tokens)
            self._step_tokens = 0

    def summary(self) -> dict:
        return {
            "ttft_p50_s": _percentile(self.ttft_s, 0.5), "ttft_p99_s": _percentile(self.ttft_s, 0.99),
            "itl_p50_s": _percentile(self.itl_s, 0.5), "itl_p99_s": _percentile(self.itl_s, 0.99),
            "queue_wait_p50_s": _percentile(self.queue_wait_s, 0.5),
            "queue_wait_p99_s": _percentile(self.queue_wait_s, 0.99),
        }


def now() -> float:
    return time.monotonic()
