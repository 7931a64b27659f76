"""GET /metrics: the engine's figures in Prometheus text format under vLLM v1's names, types,
labels and buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger), so that vLLM's Grafana
dashboard and autoscaling rules read pyserve unchanged. Every series carries model_name (the
served name) and engine (the engine index: one engine here, "0"). The collector reads the engine
at scrape time on the server's own registry: no process-global state.

prometheus_client writes a counter family named "vllm:prompt_tokens" as vllm:prompt_tokens_total,
as vLLM's Counter objects are written."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pyserve.engine.books import OUTCOMES
from pyserve.server.http import Request, Response

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name", "engine"]
ENGINE = "0"
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

# (name, help, EngineStats attribute)
HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    # deprecated in vLLM 0.11 for the one above (same figures), still read by its dashboard
    ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds. "
     "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", "itl"),
    ("vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", "time_per_output_token"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     "queue_time"),
    ("vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", "inference_time"),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
     "prefill_time"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
     "decode_time"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "prompt_len"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "generation_len"),
    ("vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
     "prefill_computed"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     "iteration_tokens"),
    ("vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", "max_generation_len"),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
     "max_tokens"),
)


class EngineCollector:
    def __init__(self, core, model_name: str):
        self.core = core
        self.labels = [model_name, ENGINE]

    def _one(self, family, value):
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        snap, stats = self.core.snapshot(), self.core.stats
        gauge = lambda name, doc, v: self._one(GaugeMetricFamily(name, doc, labels=LABELS), v)
        counter = lambda name, doc, v: self._one(CounterMetricFamily(name, doc, labels=LABELS), v)

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    snap["num_running"])
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    snap["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    snap["kv_usage"])
        if snap.get("state_usage") is not None:
            yield gauge("pyserve:state_pool_usage_perc", "Linear-attention state pool usage (rows "
                        "of running sequences). 1 means 100 percent usage.", snap["state_usage"])
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      snap["prefix_cache_queries"])
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      snap["prefix_cache_hits"])
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      snap["num_preemptions"])
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      stats.prompt_tokens)
        yield self._prompt_tokens_by_source(stats)
        yield counter("vllm:prompt_tokens_cached",
                      "Number of cached prompt tokens (local + external).",
                      stats.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      stats.generation_tokens)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=LABELS + ["finished_reason"])
        for reason, count in stats.finished_by_reason.items():
            success.add_metric(self.labels + [reason], count)
        yield success
        for name, doc, attr in HISTOGRAMS:
            hist = getattr(stats, attr)
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, hist.cumulative(), hist.sum)
            yield family
        yield self._cache_config_info()
        yield from self._books()
        if self.core.config.scheduler.speculative_config is not None:
            yield from self._spec_decode(stats, counter)

    def _spec_decode(self, stats, counter):
        """vLLM's speculative-decoding counters (only with --speculative-config, as vLLM)."""
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                      stats.spec_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      stats.spec_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      stats.spec_accepted_tokens)
        k = self.core.config.scheduler.speculative_config.num_speculative_tokens
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     labels=LABELS + ["position"])
        for position in range(k):
            family.add_metric(self.labels + [str(position)], stats.spec_accepted_per_position[position])
        yield family

    # where per-request state lives -> its figure in the books (all 0 once the server is idle)
    HOLDERS = (("request_table", "requests_in_table"), ("completions", "completions_in_table"),
               ("streams", "streams_open"), ("kv_manager", "kv_manager_requests"),
               ("runner", "runner_requests"))

    def _books(self):
        """pyserve's own accounting (engine/books.py), under pyserve: names: vLLM has none."""
        books = self.core.books()
        accepted = CounterMetricFamily("pyserve:requests_accepted",
                                       "Requests accepted by the engine.", labels=LABELS)
        yield self._one(accepted, books["requests_accepted"])
        ended = CounterMetricFamily("pyserve:requests_ended", "Requests ended, by their one "
                                    "terminal event (finished, aborted, errored).",
                                    labels=LABELS + ["outcome"])
        for outcome in OUTCOMES:
            ended.add_metric(self.labels + [outcome], books[f"requests_{outcome}"])
        yield ended
        state = GaugeMetricFamily("pyserve:request_state_entries", "Requests each per-request "
                                  "map holds state for; 0 when idle (the runner's: after the "
                                  "next step).", labels=LABELS + ["holder"])
        for holder, key in self.HOLDERS:
            if key in books:  # streams: an AsyncEngine's only
                state.add_metric(self.labels + [holder], books[key])
        yield state
        yield self._one(GaugeMetricFamily("pyserve:kv_blocks_referenced", "KV-cache blocks "
                                          "held by a request (ref count above 0); 0 when idle.",
                                          labels=LABELS), books["kv_blocks_referenced"])
        yield self._one(GaugeMetricFamily("pyserve:kv_blocks_touched", "KV-cache blocks ever "
                                          "allocated: those whose memory the cache has written "
                                          "(resident order grows it only to the most held at "
                                          "once).", labels=LABELS), books["kv_blocks_touched"])

    def _prompt_tokens_by_source(self, stats):
        family = CounterMetricFamily("vllm:prompt_tokens_by_source",
                                     "Number of prompt tokens by source.",
                                     labels=LABELS + ["source"])
        cached = stats.prompt_tokens_cached
        for source, count in zip(PROMPT_SOURCES, (stats.prompt_tokens - cached, cached, 0)):
            family.add_metric(self.labels + [source], count)
        return family

    def _cache_config_info(self):
        """vLLM's info gauge (always 1): the cache configuration in its labels, under vLLM's
        CacheConfig field names, and engine; no model_name, as in vLLM."""
        cache, core = self.core.config.cache, self.core
        info = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory),
            "num_gpu_blocks": str(core.num_kv_blocks),  # vLLM's name on every device, CPU too
            "engine": ENGINE,
        }
        family = GaugeMetricFamily("vllm:cache_config_info",
                                   "Information of the LLMEngine CacheConfig", labels=list(info))
        family.add_metric(list(info.values()), 1)
        return family


def metrics_handler(core, model_name: str):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(core, model_name))

    async def metrics(request: Request) -> Response:
        return Response(200, generate_latest(registry), content_type=CONTENT_TYPE)

    return metrics
