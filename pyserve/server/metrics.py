"""GET /metrics: the engine's figures in Prometheus text format, with vLLM's metric names
under a `pyserve:` prefix. Read from the engine at scrape time through a collector on the
server's own registry (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pyserve.server.http import Request, Response

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector:
    def __init__(self, core, model_name: str):
        self.core = core
        self.model_name = model_name

    def collect(self):
        snap, stats = self.core.snapshot(), self.core.stats
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(f"pyserve:{name}", doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(f"pyserve:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", snap["num_running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap["num_waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.", snap["kv_usage"])
        yield gauge("kv_cache_blocks_free", "Free KV-cache blocks.", snap["kv_blocks_free"])
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      snap["prefix_cache_hits"])
        yield counter("num_preemptions", "Requests preempted.", snap["num_preemptions"])
        yield counter("prompt_tokens", "Prompt tokens processed.", snap["prompt_tokens_total"])
        yield counter("generation_tokens", "Tokens generated.", snap["generation_tokens_total"])
        success = CounterMetricFamily("pyserve:request_success", "Finished requests by reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(stats.finished_by_reason.items()):
            success.add_metric([self.model_name, reason], count)
        yield success
        for name, doc, hist in (
                ("time_to_first_token_seconds", "Time to first token.", stats.ttft_histogram),
                ("inter_token_latency_seconds", "Time between tokens.", stats.itl_histogram),
                ("e2e_request_latency_seconds", "Arrival to finish.", stats.e2e_histogram)):
            h = HistogramMetricFamily(f"pyserve:{name}", doc, labels=labels)
            h.add_metric(value, hist.cumulative(), hist.sum)
            yield h


def metrics_handler(core, model_name: str):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(core, model_name))

    async def metrics(request: Request) -> Response:
        return Response(200, generate_latest(registry), content_type=CONTENT_TYPE)

    return metrics
