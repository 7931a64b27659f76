"""The engine's latency sample windows (time to first token, inter-token latency, queue wait)
take their memory once, when the engine is built: a soak's requests must not grow the server's
resident memory by a float per sample until 10,000 samples are kept (issue 20)."""

import tracemalloc
from types import SimpleNamespace

import pytest

from pyserve.engine import stats as stats_module
from pyserve.engine.stats import _SAMPLES, EngineStats, SampleWindow


def test_a_window_keeps_the_last_samples():
    window = SampleWindow(3)
    assert len(window) == 0 and list(window) == []
    for value in (1.0, 2.0):
        window.append(value)
    assert len(window) == 2 and sorted(window) == [1.0, 2.0]
    for value in (3.0, 4.0, 5.0):
        window.append(value)
    assert len(window) == 3 and sorted(window) == [3.0, 4.0, 5.0]


def test_requests_do_not_grow_the_sample_windows():
    stats = EngineStats(max_model_len=2048)
    requests = [SimpleNamespace(arrival_time=0.0, first_scheduled_time=None, first_token_time=None,
                                last_token_time=None, prompt_token_ids=[1, 2, 3],
                                num_cached_tokens=0) for _ in range(2 * _SAMPLES)]
    tracemalloc.start()
    try:
        for i, request in enumerate(requests):
            t = 1.0 + i * 1e-3  # a float object per sample, as a clock gives
            request.arrival_time = t
            stats.on_scheduled(request, t)
            stats.on_token(request, t + 0.5)
            stats.on_token(request, t + 0.75)
        # what stats.py allocated and still holds (the requests' own timestamps are the test's)
        held = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, stats_module.__file__)])
    finally:
        tracemalloc.stop()
    assert len(stats.ttft_s) == len(stats.itl_s) == len(stats.queue_wait_s) == _SAMPLES
    # a deque(maxlen=10_000) of floats held ~40 bytes a sample: about 1.2 MB here
    size = sum(stat.size for stat in held.statistics("filename"))
    assert size < 4096, f"stats.py holds {size} bytes more after {len(requests)} requests"
    summary = stats.summary()
    assert summary["ttft_p50_s"] == pytest.approx(0.5) and summary["itl_p99_s"] == pytest.approx(0.25)
    assert summary["queue_wait_p99_s"] == 0.0
