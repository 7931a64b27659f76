"""use_beam_search on /v1/completions and /v1/chat/completions, as vLLM serves it
(BeamSearchOnlineMixin.beam_search; to_beam_search_params in the completion and chat
protocols): n is the beam width and the n best beams are the n choices, best first;
length_penalty ranks finished beams; streaming sends the finished beams as chunks. The beams
must be the offline LLM.beam_search's (itself checked against a reference in
tests/engine/test_beam_search.py). What beam search cannot honour is a 400 naming the field,
and a client that leaves mid-search leaves no request running. A tiny model's server, through
the openai SDK and raw HTTP."""

import json
import socket
import time
import urllib.request

import openai
import pytest

from pyserve import LLM
from pyserve.sampling_params import BeamSearchParams
from tests.e2e.server import ServerProcess

from .wire import post, stream

pytestmark = pytest.mark.slow

MODEL = "tiny-beams"
PROMPT = "Paris is the capital of"
BEAM = {"use_beam_search": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def server(model):
    srv = ServerProcess("--model", model, "--served-model-name", MODEL, "--max-model-len", "512",
                        "--kv-cache-memory", "8MiB")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, max_model_len=512, kv_cache_memory="8MiB")


def offline(llm, prompt_ids, **params):
    """The generated ids and cumulative logprobs of LLM.beam_search's beams."""
    out = llm.beam_search({"prompt_token_ids": prompt_ids}, BeamSearchParams(**params))[0]
    return [s.tokens[len(prompt_ids):] for s in out.sequences]


def test_completions_return_the_n_best_beams(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=0,
                                    extra_body=BEAM)
    assert [c.index for c in out.choices] == [0, 1, 2]
    prompt_ids = out.choices[0].prompt_token_ids
    expected = offline(llm, prompt_ids, beam_width=3, max_tokens=8)
    assert [c.token_ids for c in out.choices] == expected
    tok = llm.get_tokenizer()
    assert [c.text for c in out.choices] == [tok.decode(ids, skip_special_tokens=True) for ids in expected]
    assert len({c.text for c in out.choices}) == 3
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len(prompt_ids)


def test_length_penalty_ranks_the_finished_beams(client, llm):
    """A token the beams write ends them (stop_token_ids), so finished beams differ in length
    and length_penalty decides which come first."""
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=0,
                                      extra_body=BEAM)
    ids = first.choices[0].prompt_token_ids
    stop = first.choices[0].token_ids[2]
    orders = {}
    for lp in (0.0, 1.0, 3.0):
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, n=3, temperature=0,
            extra_body={**BEAM, "length_penalty": lp, "stop_token_ids": [stop],
                        "include_stop_str_in_output": True})
        got = [c.token_ids for c in out.choices]
        assert got == offline(llm, ids, beam_width=3, max_tokens=8, length_penalty=lp,
                              stop_token_ids=(stop,), include_stop_str_in_output=True)
        for c in out.choices:
            assert (c.finish_reason, c.stop_reason) in (("stop", stop), ("length", None))
        orders[lp] = got
    assert orders[0.0] != orders[3.0]
    assert len(orders[0.0][0]) <= len(orders[3.0][0])  # no penalty: the short beam wins


def test_chat_returns_n_beams_with_logprobs(client, llm):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], n=2, max_completion_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=BEAM)  # vLLM's own test's shape
    assert len(out.choices) == 2
    assert out.choices[0].message.content != out.choices[1].message.content
    expected = offline(llm, out.prompt_token_ids, beam_width=2, max_tokens=6)
    assert [c.token_ids for c in out.choices] == expected
    for c in out.choices:
        assert len(c.logprobs.content) == len(c.token_ids)
        assert all(len(entry.top_logprobs) == 2 for entry in c.logprobs.content)


def test_streaming_sends_the_finished_beams_as_chunks(server, client):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "n": 2, "temperature": 0, **BEAM}
    status, whole = post(server, "/v1/completions", body)
    assert status == 200
    chunks = stream(server, "/v1/completions", body)
    texts, finishes = {}, {}
    for chunk in chunks:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"] is not None:
                finishes[c["index"]] = finishes.get(c["index"], 0) + 1
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {0: 1, 1: 1}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "n": 2, "temperature": 0, "use_beam_search": True}
    status, whole = post(server, "/v1/chat/completions", chat)
    content = {}
    for chunk in stream(server, "/v1/chat/completions", chat):
        for c in chunk["choices"]:
            content[c["index"]] = content.get(c["index"], "") + (c["delta"].get("content") or "")
    assert content == {c["index"]: c["message"]["content"] for c in whole["choices"]}


def test_a_stop_string_ends_a_beam(client):
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                      extra_body=BEAM)
    stop = first.choices[0].text[3:5]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                    stop=[stop], extra_body=BEAM)
    ended = [c for c in out.choices if c.finish_reason == "stop"]
    assert ended and all(c.stop_reason == stop and stop not in c.text for c in ended)


@pytest.mark.parametrize("extra, param", [
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"thinking_token_budget": 8}, "thinking_token_budget"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ({"n": 11}, "n"),  # 2 x 11 logprobs a step, past --max-logprobs 20 (vLLM refuses it too)
    ({"max_tokens": 600}, "max_tokens"),
    ({"length_penalty": "long"}, "length_penalty"),
    ({"priority": 1}, "priority"),  # the server schedules first come, first served
])
def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(server, extra, param):
    for path, base in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {"model": MODEL, "max_tokens": 4, "n": 2, "use_beam_search": True, **base, **extra}
        status, out = post(server, path, body)
        assert status == 400, out
        assert out["error"]["param"] == param


def test_neutral_values_are_accepted_and_temperature_defaults_to_one(client):
    """vLLM's beam search samples each round's token at the request's temperature (1.0 when
    unset): that token joins the candidates; a seed makes the search repeat."""
    def search():
        return client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, n=2, top_p=1.0, seed=7,
            extra_body={**BEAM, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0})
    first = search()
    assert len(first.choices) == 2
    assert [c.token_ids for c in search().choices] == [c.token_ids for c in first.choices]


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_a_client_leaving_mid_search_frees_every_beam(server):
    before = _metric(server, "vllm:generation_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": "Count:", "max_tokens": 480, "n": 4,
                       "ignore_eos": True, "temperature": 0, "use_beam_search": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + 30
        while _metric(server, "vllm:generation_tokens_total") < before + 40:  # some rounds ran
            assert time.monotonic() < deadline
            time.sleep(0.05)
    deadline = time.monotonic() + 10
    while _metric(server, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:num_requests_waiting") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0
    settled = _metric(server, "vllm:generation_tokens_total")
    time.sleep(0.3)
    assert _metric(server, "vllm:generation_tokens_total") == settled  # nothing runs on
    assert settled - before < 4 * 480  # the search stopped well before its end
