"""Serving metrics from per-request records, and the result block `vllm bench serve` prints.

`calculate_metrics` is a pure function of the records (see client.py for how each is timed)
and follows vLLM 0.32's definitions, so that parsers of vLLM's output and JSON read ours:

- only successful requests count; a failed one adds 0 to `output_lens` and nothing else;
- output tokens: the server's usage count, else the generated text re-encoded (count_tokens);
- TPOT per request = (latency - ttft) / (output_tokens - 1), only for outputs of more than
  one token; ITLs of all requests are pooled; E2EL is the latency;
- mean / median / std / percentiles are numpy's (linear interpolation); an empty list gives 0;
- throughputs divide by the benchmark's wall duration;
- peak output throughput: tokens bucketed by the whole second (since the first request
  started) in which they arrived, the fullest bucket; peak concurrency: the most requests
  active in any such second;
- goodput (optional): requests per second whose TTFT, TPOT and E2EL (in ms) all meet the
  given SLOs, a one-token output counting as TPOT 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from benchmarks.client import RequestResult

# (key, name in the block, section header)
METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2el", "E2EL", "End-to-end Latency"))


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def _stats(key: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = values_s or 0  # vLLM's convention: no samples reads as 0 ms
    out = {f"mean_{key}_ms": float(np.mean(values)) * 1000,
           f"median_{key}_ms": float(np.median(values)) * 1000,
           f"std_{key}_ms": float(np.std(values)) * 1000}
    for p in percentiles:
        out[f"p{percentile_word(p)}_{key}_ms"] = float(np.percentile(values, p)) * 1000
    return out


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """(most output tokens in one whole second, most requests active in one second)."""
    if not done:
        return 0.0, 0
    t0 = min(r.start_time for r in done)
    seconds = int(math.ceil(max(r.start_time + r.latency for r in done) - t0)) + 1
    tokens, active = np.zeros(seconds), np.zeros(seconds)
    for r in done:
        arrival = r.start_time + r.ttft
        for at in [arrival, *np.cumsum(r.itl) + arrival]:
            tokens[int(at - t0)] += 1
        active[int(r.start_time - t0):int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def _goodput_count(ttfts, tpots, e2els, slos_ms: dict[str, float]) -> int:
    columns = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    picked = [(columns[k], v / 1000) for k, v in slos_ms.items()]
    return sum(all(col[i] <= slo for col, slo in picked) for i in range(len(ttfts)))


def calculate_metrics(records: Sequence[RequestResult], duration_s: float,
                      count_tokens: Callable[[str], int] | None,
                      percentiles: Sequence[float] = (99,),
                      goodput_slos_ms: dict[str, float] | None = None) -> dict:
    """records -> vLLM's result keys (completed, failed, total_input_tokens, ..., output_lens,
    mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ... for ttft, tpot, itl, e2el)."""
    output_lens, ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], [], []
    total_input = 0
    for r in records:
        if not r.success:
            output_lens.append(0)
            continue
        n = r.output_tokens or (count_tokens(r.generated_text) if count_tokens else 1)
        output_lens.append(n)
        total_input += r.prompt_len
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        if n > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += r.itl
        ttfts.append(r.ttft)
        e2els.append(r.latency)
    done = [r for r in records if r.success]
    total_output = sum(output_lens)
    peak_tokens, peak_active = _peaks(done)
    good = _goodput_count(ttfts, all_tpots, e2els, goodput_slos_ms) if goodput_slos_ms else None
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "output_lens": output_lens,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_active,
    }
    for key, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(key, values, percentiles))
    return result


def _line(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def format_result(m: dict, *, max_concurrency: int | None, request_rate: float,
                  percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The "Serving Benchmark Result" block, character for character as vLLM 0.32 prints it."""
    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             _line("Successful requests:", m["completed"]),
             _line("Failed requests:", m["failed"])]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", m["duration"], ".2f"),
              _line("Total input tokens:", m["total_input_tokens"]),
              _line("Total generated tokens:", m["total_output_tokens"]),
              _line("Request throughput (req/s):", m["request_throughput"], ".2f")]
    if m.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", m["request_goodput"], ".2f"))
    lines += [_line("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
              _line("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"], ".2f"),
              _line("Peak concurrent requests:", m["max_concurrent_requests"], ".2f"),
              _line("Total token throughput (tok/s):", m["total_token_throughput"], ".2f")]
    for key, name, header in METRICS:
        if key not in percentile_metrics:
            continue
        lines += ["{:-^50}".format(header),
                  _line(f"Mean {name} (ms):", m[f"mean_{key}_ms"], ".2f"),
                  _line(f"Median {name} (ms):", m[f"median_{key}_ms"], ".2f")]
        for p in percentiles:
            word = percentile_word(p)
            lines.append(_line(f"P{word} {name} (ms):", m[f"p{word}_{key}_ms"], ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)
