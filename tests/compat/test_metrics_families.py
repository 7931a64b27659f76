"""vLLM's metric families as its own server tests read them (tests/entrypoints/openai/
test_metrics.py, vllm/v1/metrics/loggers.py): after N completions of a known prompt and
max_tokens, each family's _count and _sum are exact, its buckets are vLLM's and every
observation sits in the bucket vLLM's would put it in. A real server over a real socket, driven
through the openai SDK; figures read as deltas, so the tests do not depend on their order."""

import json
import math
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from ..e2e.server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-metrics"
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings
KV_CACHE = 4 * 1024**2
# the tiny llama's float32 KV bytes per 16-token block: 2 layers x (K, V) x 2 heads x 16 x 4
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16
PROMPT = "The quick brown fox jumps over the lazy dog."

# vLLM's bucket lists (loggers.py): build_1_2_5_buckets(max_model_len) for token counts
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
BUCKETS = {
    "vllm:iteration_tokens_total": ITERATION_BUCKETS,
    "vllm:request_prompt_tokens": TOKEN_BUCKETS,
    "vllm:request_generation_tokens": TOKEN_BUCKETS,
    "vllm:request_params_n": N_BUCKETS,
    "vllm:request_params_max_tokens": TOKEN_BUCKETS,
    "vllm:request_queue_time_seconds": LATENCY_BUCKETS,
    "vllm:request_inference_time_seconds": LATENCY_BUCKETS,
    "vllm:request_prefill_time_seconds": LATENCY_BUCKETS,
    "vllm:request_decode_time_seconds": LATENCY_BUCKETS,
}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess("--model", str(tiny_model_factory("llama")), "--served-model-name", MODEL,
                        "--kv-cache-memory", str(KV_CACHE))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def prompt_ids(server) -> list[int]:
    body = json.dumps({"prompt": PROMPT}).encode()
    request = urllib.request.Request(server.url + "/tokenize", data=body,
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())["tokens"]


def scrape(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, suffix="", **labels) -> float:
    found = [s for s in families[name].samples if s.name == name + suffix
             and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, suffix, labels, len(found))
    return found[0].value


def buckets(families, name) -> dict[str, float]:
    return {s.labels["le"]: s.value for s in families[name].samples if s.name == name + "_bucket"}


def expected_buckets(bounds, observations) -> dict[str, float]:
    """What vLLM's Histogram(buckets=bounds) shows after observing these values."""
    les = [floatToGoString(float(b)) for b in bounds] + ["+Inf"]
    bound = lambda le: math.inf if le == "+Inf" else float(le)
    return {le: float(sum(1 for v in observations if v <= bound(le))) for le in les}


def delta(before, after, name, suffix="", **labels) -> float:
    return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)


def bucket_delta(before, after, name) -> dict[str, float]:
    b, a = buckets(before, name), buckets(after, name)
    return {le: a[le] - b[le] for le in a}


def test_families_have_vllm_types_labels_and_buckets(server):
    families = scrape(server)
    for name, bounds in BUCKETS.items():
        family = families[name]
        assert family.type == "histogram", name
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0", sample
        les = [floatToGoString(float(b)) for b in bounds] + ["+Inf"]
        assert list(buckets(families, name)) == les, name
    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
        assert families[name].type == "counter", name


def test_counts_after_n_completions_are_exactly_vllms(server, client, prompt_ids):
    n_requests, max_tokens, p = 6, 10, len(prompt_ids)
    before = scrape(server)
    for _ in range(n_requests):  # one at a time, as vLLM's test sends them
        out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=max_tokens,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.prompt_tokens == p and out.usage.completion_tokens == max_tokens
    after = scrape(server)

    # vLLM's _get_expected_values(num_requests, prompt_ids, max_tokens)
    expected = {
        "vllm:time_to_first_token_seconds": [("_count", n_requests)],
        "vllm:inter_token_latency_seconds": [("_count", n_requests * (max_tokens - 1))],
        "vllm:time_per_output_token_seconds": [("_count", n_requests * (max_tokens - 1))],
        "vllm:e2e_request_latency_seconds": [("_count", n_requests)],
        "vllm:request_queue_time_seconds": [("_count", n_requests)],
        "vllm:request_inference_time_seconds": [("_count", n_requests)],
        "vllm:request_prefill_time_seconds": [("_count", n_requests)],
        "vllm:request_decode_time_seconds": [("_count", n_requests)],
        "vllm:request_prompt_tokens": [("_sum", n_requests * p), ("_count", n_requests)],
        "vllm:request_generation_tokens": [("_sum", n_requests * max_tokens),
                                           ("_count", n_requests)],
        "vllm:request_params_n": [("_sum", n_requests), ("_count", n_requests)],
        "vllm:request_params_max_tokens": [("_sum", n_requests * max_tokens),
                                           ("_count", n_requests)],
        # one step per token: the prefill step carries the prompt and the first token
        "vllm:iteration_tokens_total": [("_sum", n_requests * (p + max_tokens)),
                                        ("_count", n_requests * max_tokens)],
        "vllm:prompt_tokens": [("_total", n_requests * p)],
        "vllm:generation_tokens": [("_total", n_requests * max_tokens)],
    }
    for name, checks in expected.items():
        for suffix, want in checks:
            assert delta(before, after, name, suffix) == want, (name, suffix)
    success = lambda reason: delta(before, after, "vllm:request_success", "_total",
                                   finished_reason=reason)
    assert success("length") == n_requests and success("stop") == 0

    # each observation in the bucket vLLM's would put it in
    observed = {
        "vllm:request_prompt_tokens": [p] * n_requests,
        "vllm:request_generation_tokens": [max_tokens] * n_requests,
        "vllm:request_params_n": [1] * n_requests,
        "vllm:request_params_max_tokens": [max_tokens] * n_requests,
        "vllm:iteration_tokens_total": [p + 1] * n_requests + [1] * (n_requests * (max_tokens - 1)),
    }
    for name, values in observed.items():
        assert bucket_delta(before, after, name) == expected_buckets(BUCKETS[name], values), name

    # the phases of a request: inference = prefill + decode; e2e covers queue + inference
    sums = {name: delta(before, after, f"vllm:request_{name}_time_seconds", "_sum")
            for name in ("queue", "inference", "prefill", "decode")}
    assert all(v >= 0 for v in sums.values()) and sums["decode"] > 0, sums
    assert sums["inference"] == pytest.approx(sums["prefill"] + sums["decode"], abs=1e-6)
    e2e = delta(before, after, "vllm:e2e_request_latency_seconds", "_sum")
    assert e2e >= sums["queue"] + sums["inference"] - 1e-6


def test_n_is_one_request_and_n_finished_completions(server, client, prompt_ids):
    """vLLM fans n out into n child requests: each is a finished request (tokens, max_tokens,
    phases); n and the longest completion are observed once, for the parent."""
    n, max_tokens, p = 3, 4, len(prompt_ids)
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt=prompt_ids, n=n, max_tokens=max_tokens,
                                    temperature=0.8, seed=11, extra_body={"ignore_eos": True})
    assert len(out.choices) == n
    after = scrape(server)
    assert delta(before, after, "vllm:request_params_n", "_count") == 1
    assert delta(before, after, "vllm:request_params_n", "_sum") == n
    assert bucket_delta(before, after, "vllm:request_params_n") == expected_buckets(N_BUCKETS, [n])
    assert delta(before, after, "vllm:request_max_num_generation_tokens", "_count") == 1
    assert delta(before, after, "vllm:request_max_num_generation_tokens", "_sum") == max_tokens
    for name, per_completion in (("vllm:request_params_max_tokens", max_tokens),
                                 ("vllm:request_generation_tokens", max_tokens),
                                 ("vllm:request_prompt_tokens", p)):
        assert delta(before, after, name, "_count") == n, name
        assert delta(before, after, name, "_sum") == n * per_completion, name
    for phase in ("queue", "inference", "prefill", "decode"):
        assert delta(before, after, f"vllm:request_{phase}_time_seconds", "_count") == n
    assert delta(before, after, "vllm:request_success", "_total", finished_reason="length") == n
    assert delta(before, after, "vllm:iteration_tokens_total", "_sum") == n * (p + max_tokens)


def test_chat_requests_count_their_templated_prompt(server, client):
    before = scrape(server)
    out = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0,
                                         messages=[{"role": "user", "content": "Hello there"}],
                                         extra_body={"ignore_eos": True})
    after = scrape(server)
    prompt = out.usage.prompt_tokens
    assert out.usage.completion_tokens == 5
    assert delta(before, after, "vllm:request_prompt_tokens", "_sum") == prompt
    assert delta(before, after, "vllm:request_params_max_tokens", "_sum") == 5
    assert delta(before, after, "vllm:request_generation_tokens", "_sum") == 5
    assert delta(before, after, "vllm:iteration_tokens_total", "_count") == 5
    assert delta(before, after, "vllm:iteration_tokens_total", "_sum") == prompt + 5


def test_a_one_token_request_is_a_finished_request_with_no_decode(server, client, prompt_ids):
    """vLLM's FinishedRequestStats: one generated token means no decode phase; the request's
    time per output token is observed as 0 (never skipped), its inter-token latency not at all."""
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0)
    after = scrape(server)
    name = "vllm:request_time_per_output_token_seconds"
    assert delta(before, after, name, "_count") == 1 and delta(before, after, name, "_sum") == 0
    assert bucket_delta(before, after, name)["0.01"] == 1
    assert delta(before, after, "vllm:request_decode_time_seconds", "_count") == 1
    assert delta(before, after, "vllm:request_decode_time_seconds", "_sum") == 0
    assert delta(before, after, "vllm:inter_token_latency_seconds", "_count") == 0
    assert delta(before, after, "vllm:iteration_tokens_total", "_sum") == len(prompt_ids) + 1


def test_a_refused_request_moves_no_family(server, client, prompt_ids):
    before = scrape(server)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=MAX_MODEL_LEN)
    after = scrape(server)
    for name in BUCKETS:
        assert delta(before, after, name, "_count") == 0, name
    assert delta(before, after, "vllm:prompt_tokens", "_total") == 0


def test_cache_config_info_is_an_info_gauge_of_the_cache_config(server):
    family = scrape(server)["vllm:cache_config_info"]
    assert family.type == "gauge"
    (sample,) = family.samples
    assert sample.value == 1
    labels = sample.labels
    assert "model_name" not in labels and labels["engine"] == "0"  # as vLLM's labels
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["num_gpu_blocks"] == str(KV_CACHE // BLOCK_BYTES)
    assert labels["kv_cache_memory_bytes"] == str(KV_CACHE)
    assert labels["cache_dtype"] == "auto" and labels["gpu_memory_utilization"] == "0.9"
