"""/metrics' collector on a real engine (a tiny random Llama): vLLM's names, types, labels and
buckets, and figures that agree with what the engine did."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pyserve.config import Config
from pyserve.engine.core import EngineCore
from pyserve.sampling_params import SamplingParams
from pyserve.engine.stats import (ITERATION_TOKEN_BUCKETS, ITL_BUCKETS, N_BUCKETS,
                                  REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, buckets_1_2_5)
from pyserve.server.metrics import EngineCollector

MODEL = "tiny-served-name"
MAX_MODEL_LEN = 512  # tools/make_tiny_model.py's max_position_embeddings
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
SECONDS = {"vllm:time_to_first_token_seconds": TTFT_BUCKETS,
           "vllm:inter_token_latency_seconds": ITL_BUCKETS,
           "vllm:time_per_output_token_seconds": ITL_BUCKETS,
           "vllm:request_time_per_output_token_seconds": ITL_BUCKETS,
           **{f"vllm:{name}": REQUEST_LATENCY_BUCKETS for name in (
               "e2e_request_latency_seconds", "request_queue_time_seconds",
               "request_inference_time_seconds", "request_prefill_time_seconds",
               "request_decode_time_seconds")}}
COUNTS = {"vllm:iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
          "vllm:request_params_n": N_BUCKETS,
          **{f"vllm:{name}": TOKENS for name in (
              "request_prompt_tokens", "request_generation_tokens",
              "request_prefill_kv_computed_tokens", "request_max_num_generation_tokens",
              "request_params_max_tokens")}}
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info",
          "pyserve:request_state_entries", "pyserve:kv_blocks_referenced",  # the books, ours
          "pyserve:kv_blocks_touched")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
            "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached",
            "vllm:generation_tokens", "vllm:request_success",
            "pyserve:requests_accepted", "pyserve:requests_ended")


def test_buckets_1_2_5_as_vllm_builds_them():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(MAX_MODEL_LEN) == TOKENS
    assert buckets_1_2_5(8192)[-2:] == (2000, 5000)


def scrape(core) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(core, MODEL))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def value(family, suffix="", **labels) -> float:
    matches = [s.value for s in family.samples if s.name == family.name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matches) == 1, (family.name, suffix, labels)
    return matches[0]


@pytest.fixture(scope="module")
def engine_run(tiny_model_factory):
    """Requests of every kind through a real engine: n=2, repeated prompts (prefix-cache hits),
    one ended by length, one aborted mid-way."""
    core = EngineCore(Config.from_flat(model=str(tiny_model_factory("llama")),
                                       kv_cache_memory="16MiB", max_num_batched_tokens=32))
    tok = core.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    hello = tok.encode("Hello")
    assert len(prompt) > 2 * core.kv.block_size
    before = scrape(core)
    core.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    core.add_request("b", prompt, SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=4,
                                                 ignore_eos=True))
    core.add_request("c", hello, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    generated = {}
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            for c in out.outputs:
                generated[(out.request_id, c.index)] = len(c.token_ids)
        steps += 1
        if steps == 3:
            core.abort("c")
    return core, before, scrape(core), len(prompt), len(hello), generated


def test_names_types_labels_and_buckets_are_vllms(engine_run):
    core, _, families, *_ = engine_run
    expected = {**{n: "gauge" for n in GAUGES}, **{n: "counter" for n in COUNTERS},
                **{n: "histogram" for n in (*SECONDS, *COUNTS)}}
    assert {name: f.type for name, f in families.items()} == expected
    for name, family in families.items():
        for sample in family.samples:
            if name == "vllm:cache_config_info":
                assert "model_name" not in sample.labels and sample.labels["engine"] == "0"
                continue
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    for name, bounds in {**SECONDS, **COUNTS}.items():
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert les == [repr(float(b)) for b in bounds] + ["+Inf"], name
    # counters as vLLM's appear: the _total sample of the family
    assert {s.name for s in families["vllm:prompt_tokens"].samples} == {"vllm:prompt_tokens_total"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    sources = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["enable_prefix_caching"] == "True"
    assert info.labels["num_gpu_blocks"] == str(core.kv.num_blocks)


def test_figures_follow_what_the_engine_did(engine_run):
    core, before, after, prompt_len, hello_len, generated = engine_run
    # before any request: every series there, at zero
    assert value(before["vllm:generation_tokens"], "_total") == 0
    assert value(before["vllm:time_to_first_token_seconds"], "_count") == 0
    # a (6 tokens) and b's two completions (4 each) finished by length; c was aborted: not counted
    success = after["vllm:request_success"]
    assert value(success, "_total", finished_reason="length") == 3
    assert value(success, "_total", finished_reason="abort") == 0
    assert value(success, "_total", finished_reason="stop") == 0
    assert value(after["vllm:e2e_request_latency_seconds"], "_count") == 3
    assert value(after["vllm:request_generation_tokens"], "_sum") == 6 + 4 + 4
    assert value(after["vllm:request_prompt_tokens"], "_sum") == 3 * prompt_len
    assert value(after["vllm:request_params_max_tokens"], "_sum") == 6 + 4 + 4
    # n and the longest completion: once per request, when its last completion is done
    assert value(after["vllm:request_params_n"], "_count") == 2
    assert value(after["vllm:request_params_n"], "_sum") == 1 + 2
    assert value(after["vllm:request_max_num_generation_tokens"], "_sum") == 6 + 4
    # the aborted request's tokens still count; every token is in the iteration histogram
    c_tokens = generated.get(("c", 0), 0)
    gen = value(after["vllm:generation_tokens"], "_total")
    assert gen == 14 + c_tokens and c_tokens > 0
    prompt = value(after["vllm:prompt_tokens"], "_total")
    assert prompt == 3 * prompt_len + hello_len  # counted at each completion's first token
    assert value(after["vllm:iteration_tokens_total"], "_sum") == prompt + gen
    # the second and third completions of the same prompt found it cached
    cached = value(after["vllm:prompt_tokens_cached"], "_total")
    assert cached > 0 and cached == value(after["vllm:prefix_cache_hits"], "_total")
    by_source = after["vllm:prompt_tokens_by_source"]
    assert value(by_source, "_total", source="local_cache_hit") == cached
    assert value(by_source, "_total", source="local_compute") == prompt - cached
    assert value(after["vllm:request_prefill_kv_computed_tokens"], "_sum") == (
        3 * prompt_len - cached)
    assert value(after["vllm:prefix_cache_queries"], "_total") >= prompt
    # timings: one TTFT per completion that got a token, an ITL per later token
    assert value(after["vllm:time_to_first_token_seconds"], "_count") == 4
    assert value(after["vllm:inter_token_latency_seconds"], "_count") == gen - 4
    assert value(after["vllm:time_per_output_token_seconds"], "_count") == gen - 4
    assert value(after["vllm:request_time_per_output_token_seconds"], "_count") == 3
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds"):
        assert value(after[f"vllm:{name}"], "_count") == 3
    # inference = prefill + decode for each request, so the sums add up too
    assert value(after["vllm:request_inference_time_seconds"], "_sum") == pytest.approx(
        value(after["vllm:request_prefill_time_seconds"], "_sum")
        + value(after["vllm:request_decode_time_seconds"], "_sum"))
    assert value(after["vllm:num_requests_running"]) == 0
    assert value(after["vllm:num_requests_waiting"]) == 0
    assert value(after["vllm:kv_cache_usage_perc"]) == 0.0


def test_the_books_balance_after_the_run(engine_run):
    core, before, after, *_ = engine_run
    assert value(before["pyserve:requests_accepted"], "_total") == 0
    assert value(after["pyserve:requests_accepted"], "_total") == 3
    ended = {o: value(after["pyserve:requests_ended"], "_total", outcome=o)
             for o in ("finished", "aborted", "errored")}
    assert ended == {"finished": 2, "aborted": 1, "errored": 0}
    holders = {s.labels["holder"]: s.value for s in after["pyserve:request_state_entries"].samples}
    assert holders["request_table"] == holders["kv_manager"] == 0 and "streams" not in holders
    assert value(after["pyserve:kv_blocks_referenced"]) == 0
    assert value(after["pyserve:kv_blocks_touched"]) >= value(before["pyserve:kv_blocks_touched"])
    assert value(after["pyserve:kv_blocks_touched"]) > 0
