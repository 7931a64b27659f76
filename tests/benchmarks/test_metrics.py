"""benchmarks/metrics.py on hand-made records: every figure below is worked out by hand."""

import pytest

from benchmarks.client import RequestResult
from benchmarks.metrics import calculate_metrics, format_result


def words(text: str) -> int:  # a stand-in tokenizer: one token per word
    return len(text.split())


# A: 4 tokens from the server's usage; B: one token; C: failed; D: no usage, 3 words of text
RECORDS = [
    RequestResult(True, "", 10, 4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, start_time=0.0),
    RequestResult(True, "x", 20, 1, ttft=0.3, itl=[], latency=0.3, start_time=0.5),
    RequestResult(False, "", 5, 0, error="HTTP 500"),
    RequestResult(True, "a b c", 30, 0, ttft=0.2, itl=[0.1, 0.1], latency=0.4, start_time=1.0),
]


def test_counts_and_throughputs_exclude_failed_requests():
    m = calculate_metrics(RECORDS, 2.0, words)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 60  # 10 + 20 + 30: the failed request's 5 do not count
    assert m["total_output_tokens"] == 8  # 4 (usage) + 1 (usage) + 3 (re-counted text)
    assert m["output_lens"] == [4, 1, 0, 3]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)


def test_latency_statistics():
    m = calculate_metrics(RECORDS, 2.0, words, percentiles=(50, 99))
    # TTFT 0.1, 0.3, 0.2 s; p99 interpolates linearly as numpy does: 0.2 + 0.98 * 0.1
    assert m["mean_ttft_ms"] == pytest.approx(200)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(298)
    # TPOT: A (0.2 - 0.1) / 3, D (0.4 - 0.2) / 2; B's single token gives none
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["p99_tpot_ms"] == pytest.approx(100 / 3 + 0.99 * (100 - 100 / 3))
    # ITLs pooled over requests: 20, 30, 50, 100, 100 ms
    assert m["mean_itl_ms"] == pytest.approx(60)
    assert m["median_itl_ms"] == m["p50_itl_ms"] == pytest.approx(50)
    assert m["p99_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(300)
    assert m["std_e2el_ms"] == pytest.approx(81.6497, rel=1e-4)


def test_one_token_output_has_no_tpot_and_empty_lists_read_as_zero():
    m = calculate_metrics([RECORDS[1]], 1.0, words)
    assert m["mean_tpot_ms"] == m["median_tpot_ms"] == m["p99_tpot_ms"] == 0.0
    assert m["mean_itl_ms"] == 0.0 and m["mean_ttft_ms"] == pytest.approx(300)
    none = calculate_metrics([RECORDS[2]], 1.0, words)
    assert none["completed"] == 0 and none["mean_ttft_ms"] == 0.0
    assert none["max_output_tokens_per_s"] == 0.0 and none["max_concurrent_requests"] == 0


def test_peaks_bucket_by_whole_seconds():
    m = calculate_metrics(RECORDS, 2.0, words)
    # tokens at 0.1 .12 .15 .2 (A) and .8 (B) fall in second 0, D's at 1.2 1.3 1.4 in second 1
    assert m["max_output_tokens_per_s"] == 5.0
    assert m["max_concurrent_requests"] == 2  # A and B are both active in second 0


def test_goodput_counts_requests_meeting_every_slo():
    assert calculate_metrics(RECORDS, 2.0, words)["request_goodput"] is None
    assert calculate_metrics(RECORDS, 2.0, words, goodput_slos_ms={"ttft": 250})[
        "request_goodput"] == pytest.approx(1.0)  # A and D
    # B's single token counts as TPOT 0; D's 100 ms TPOT misses
    assert calculate_metrics(RECORDS, 2.0, words, goodput_slos_ms={"ttft": 250, "tpot": 50})[
        "request_goodput"] == pytest.approx(0.5)


def test_printed_block_has_vllm_widths():
    m = calculate_metrics(RECORDS, 2.0, words)
    text = format_result(m, max_concurrency=4, request_rate=float("inf"),
                         percentile_metrics=["ttft", "tpot", "itl"], percentiles=[99])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:" + " " * 21 + "3" + " " * 9
    assert "Failed requests:" + " " * 25 + "1" + " " * 9 in lines
    assert "Maximum request concurrency:" + " " * 13 + "4" + " " * 9 in lines
    assert "Benchmark duration (s):" + " " * 18 + "2.00" + " " * 6 in lines
    assert "Peak concurrent requests:" + " " * 16 + "2.00" + " " * 6 in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "Mean TTFT (ms):" + " " * 26 + "200.00" + " " * 4 in lines
    assert "P99 TTFT (ms):" + " " * 27 + "298.00" + " " * 4 in lines
    assert "Request rate configured (RPS):" not in text and "E2EL" not in text
    assert lines[-1] == "=" * 50
    labels = [line[:40].rstrip() for line in lines[1:12]]
    assert labels == ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
                      "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                      "Request throughput (req/s):", "Output token throughput (tok/s):",
                      "Peak output token throughput (tok/s):", "Peak concurrent requests:",
                      "Total token throughput (tok/s):"]
    m = calculate_metrics(RECORDS, 2.0, words, percentiles=(50, 99.9))
    with_rate = format_result(m, max_concurrency=None, request_rate=4.0,
                              percentile_metrics=["e2el"], percentiles=[50, 99.9])
    assert "Request rate configured (RPS):" + " " * 11 + "4.00" + " " * 6 in with_rate
    assert "Maximum request concurrency:" not in with_rate
    assert "----------------End-to-end Latency----------------" in with_rate
    assert "P99.9 E2EL (ms):" in with_rate and "TTFT" not in with_rate
