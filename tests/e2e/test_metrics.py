"""/metrics end to end: a real server under KV-cache pressure, driven through the openai SDK,
exposes vLLM's metrics with vLLM's labels, and every one of them moves."""

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# SmolLM2-135M's float32 KV bytes per 16-token block (2 x 30 layers x 3 heads x 64 x 16 x 4):
# 24 blocks hold 384 tokens, less than 4 running requests of ~125 tokens each need
BLOCK = 2 * 30 * 3 * 64 * 16 * 4
PREFIX = "You are a helpful assistant. Answer briefly and precisely. The quick brown fox. "
QUESTIONS = ("Count from one:", "Name some colours:", "List some fruits:", "Say the alphabet:",
             "Name some animals:", "List some cities:", "Count backwards:", "Name some trees:")
MAX_TOKENS = 100

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
            "generation_tokens", "prompt_tokens_cached")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "time_per_output_token_seconds", "request_time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_prompt_tokens",
              "request_generation_tokens", "request_prefill_kv_computed_tokens",
              "iteration_tokens_total", "request_params_n", "request_params_max_tokens",
              "request_max_num_generation_tokens")


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--kv-cache-memory", str(24 * BLOCK), "--max-model-len", "256",
                        "--max-num-seqs", "4")
    yield srv
    assert srv.stop() == 0


def scrape(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families, name, suffix="", **labels) -> float:
    family = families[name]
    found = [s for s in family.samples if s.name == name + suffix
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, suffix, labels)
    assert found[0].labels["model_name"] == MODEL and found[0].labels["engine"] == "0"
    return found[0].value


def test_every_vllm_metric_is_there_and_moves(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    before = scrape(server)
    assert sample(before, "vllm:generation_tokens", "_total") == 0

    def complete(question):
        return client.completions.create(model=MODEL, prompt=PREFIX + question, temperature=0,
                                         max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})

    # eight long requests, four at a time, against room for about three: some wait, some are
    # preempted; the gauges are read while they run
    peaks = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
             "vllm:kv_cache_usage_perc": 0.0}
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(complete, q) for q in QUESTIONS]
        while not all(f.done() for f in futures):
            now = scrape(server)
            for name in peaks:
                peaks[name] = max(peaks[name], sample(now, name))
            time.sleep(0.05)
        outs = [f.result() for f in futures]
    assert all(o.choices[0].finish_reason == "length" for o in outs)
    two = client.completions.create(model=MODEL, prompt=PREFIX + "Two ways to say hello:", n=2,
                                    max_tokens=5, temperature=0.8, seed=3,
                                    extra_body={"ignore_eos": True})
    assert len(two.choices) == 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=64, temperature=0)
    assert chat.choices[0].finish_reason == "stop"

    after = scrape(server)  # a step's figures are recorded before its outputs go out
    assert all(v > 0 for v in peaks.values()), peaks
    for name in peaks:
        assert sample(after, name) == 0
    for name in COUNTERS:
        moved = sample(after, f"vllm:{name}", "_total") - sample(before, f"vllm:{name}", "_total")
        assert moved > 0, name
    for name in HISTOGRAMS:
        assert sample(after, f"vllm:{name}", "_count") > 0, name
        assert sample(after, f"vllm:{name}", "_sum") > 0, name
    success = lambda reason: sample(after, "vllm:request_success", "_total", finished_reason=reason)
    assert success("length") == len(QUESTIONS) + 2 and success("stop") == 1
    assert success("abort") == 0 and success("error") == 0
    # the requests' own parameters: n = 1 for ten requests and 2 for one, max_tokens per completion
    assert sample(after, "vllm:request_params_n", "_count") == len(QUESTIONS) + 2
    assert sample(after, "vllm:request_params_n", "_sum") == len(QUESTIONS) + 1 + 2
    assert sample(after, "vllm:request_params_n", "_bucket", le="1.0") == len(QUESTIONS) + 1
    assert sample(after, "vllm:request_params_max_tokens", "_count") == len(QUESTIONS) + 3
    assert sample(after, "vllm:request_params_max_tokens", "_sum") == (
        MAX_TOKENS * len(QUESTIONS) + 2 * 5 + 64)
    assert sample(after, "vllm:request_generation_tokens", "_sum") == (
        MAX_TOKENS * len(QUESTIONS) + 2 * 5 + chat.usage.completion_tokens)
    assert sample(after, "vllm:generation_tokens", "_total") == sample(
        after, "vllm:request_generation_tokens", "_sum")
    by_source = lambda src: sample(after, "vllm:prompt_tokens_by_source", "_total", source=src)
    assert by_source("local_cache_hit") == sample(after, "vllm:prompt_tokens_cached", "_total") > 0
    assert by_source("local_compute") + by_source("local_cache_hit") == sample(
        after, "vllm:prompt_tokens", "_total")
    info = after["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["num_gpu_blocks"] == "24"
