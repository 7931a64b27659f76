"""The server end to end: the real `python -m pyserve` on a loopback port, spoken to only through
the official openai SDK and raw sockets."""

import json
import socket

import openai
import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--enable-debug-endpoints")  # its books are checked as it stops
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


MODEL = "SmolLM2-135M-Instruct"


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_gives_a_sensible_answer(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.tool_calls == []  # vLLM's empty list, not None
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens > 0 and out.usage.total_tokens == (
        out.usage.prompt_tokens + out.usage.completion_tokens)


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 16
    assert whole.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, stream=True, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hi"}])
    deltas = list(chat)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert deltas[-1].choices[0].finish_reason in ("stop", "length")


def test_n_seed_stop_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                    temperature=1.0, seed=3, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) for c in out.choices)
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                      temperature=1.0, seed=3, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = full.choices[0].text.strip().split(",")[1].strip() or "5"
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens


@pytest.mark.parametrize("kwargs,status,param", [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=1.5), 400, "top_p"),
    (dict(max_tokens=100000), 400, "max_tokens"),
    (dict(model="no-such-model"), 404, "model"),
    (dict(prompt=""), 400, None),
    (dict(n=129), 400, "n"),
    (dict(stop=["x"] * 65), 400, "stop"),
    (dict(logprobs=21), 400, "logprobs"),
    (dict(prompt=[1, 999999]), 400, None),
])
def test_errors_have_openai_shape(client, kwargs, status, param):
    args = dict(model=MODEL, prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(**args)
    assert exc.value.status_code == status
    body = exc.value.body
    assert set(body) >= {"message", "type", "param", "code"} and body["code"] == status
    if param:
        assert body["param"] == param and param.split("_")[0] in body["message"]


def raw(server, data: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_malformed_json_and_http(server):
    status, body = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = raw(server, b"BLAH\r\n\r\n")
    assert status == 400
    status, body = raw(server, b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404


SMUGGLING = [  # each after a complete request on the same connection, as a smuggler sends it
    b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
    b"Transfer-Encoding: chunked\r\nTransfer-encoding: cow\r\n\r\n0\r\n\r\n",
    b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"Content-Length: +5\r\n\r\nhello",
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
]


@pytest.mark.parametrize("framing", SMUGGLING)
def test_request_smuggling_shapes_get_400_and_close(server, framing):
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /tokenize HTTP/1.1\r\nHost: x\r\n" + framing)
        reply = b""
        while chunk := s.recv(65536):  # the server closes
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.count(b"HTTP/1.1 ") == 2
    assert b"HTTP/1.1 400 " in reply and reply.rstrip().endswith(b"}")


def test_debug_books(server):
    status, body, _ = http_json(server, "GET", "/debug/books")
    books = json.loads(body)
    assert status == 200 and set(books) == {"books", "idle", "balanced", "problems"}
    assert books["books"]["requests_accepted"] == sum(
        books["books"][f"requests_{o}"] for o in ("finished", "aborted", "errored"))


def test_api_key(default_model_dir):
    srv = ServerProcess("--api-key", "sekret", "--served-model-name", "house-model",
                        "--enable-debug-endpoints")
    try:
        bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        for sneaky in ("//v1/models", "/v1/models/", "/v1/%6Dodels"):
            status, _ = raw(srv, f"GET {sneaky} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert status == 401
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == "house-model"
        status, body = raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200 and body == {"status": "ok"}
        # every route but the health ones needs the key (a Prometheus scraper sends it too)
        status, _, headers = http_json(srv, "GET", "/metrics")
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        status, _, _ = http_json(srv, "GET", "/metrics", headers={"Authorization": "Bearer sekret"})
        assert status == 200
        assert http_json(srv, "GET", "/debug/books")[0] == 401
    finally:
        assert srv.stop() == 0


def http_json(server, method, path, body=None, headers=None):
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}


def test_tokenize_and_detokenize(server):
    status, body, _ = http_json(server, "POST", "/tokenize", {"prompt": "Hello world"})
    out = json.loads(body)
    assert status == 200 and out["count"] == len(out["tokens"]) and out["max_model_len"] == 8192
    status, body, _ = http_json(server, "POST", "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == "Hello world"
    status, body, _ = http_json(server, "POST", "/detokenize", {"tokens": [-1]})
    assert status == 400 and json.loads(body)["error"]["param"] == "tokens"
    status, body, _ = http_json(server, "POST", "/tokenize",
                                {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and json.loads(body)["count"] > 5


def test_metrics_and_a_client_leaving_mid_stream(server, client):
    def metric(text, name):
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    # a client that reads two chunks of a long stream, then hangs up
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        body = json.dumps({"prompt": "Count to a thousand:", "max_tokens": 2000, "stream": True,
                           "ignore_eos": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += s.recv(65536)
    import time

    deadline = time.monotonic() + 10
    while True:
        status, text, headers = http_json(server, "GET", "/metrics")
        text = text.decode()
        if metric(text, "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert metric(text, "vllm:num_requests_running") == 0
    # as in vLLM, a request its client abandons is not a finished request; the series is there
    assert ('vllm:request_success_total{engine="0",finished_reason="abort",'
            f'model_name="{MODEL}"}} 0.0') in text
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "vllm:generation_tokens_total") > 0
    aborted = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pyserve:requests_ended_total{") and 'outcome="aborted"' in line]
    assert aborted and aborted[0] >= 1  # the books count it, as an abort
    assert "vllm:time_to_first_token_seconds_bucket" in text


def test_echo_prompt_logprobs_and_continuous_usage(server, client):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0,
                                    echo=True, extra_body={"prompt_logprobs": 1})
    choice = out.choices[0]
    assert choice.text.startswith("The sky is") and len(choice.text) > len("The sky is")
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == out.usage.prompt_tokens
    assert all(entry["decoded_token"] for p in prompt_lp[1:] for entry in p.values())
    chunks = list(client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == [1, 2, 3]


def test_batched_and_token_prompts_text_parts_and_stop_reason(client):
    batch = client.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], max_tokens=3,
                                      temperature=0, user="tester")
    assert sorted(c.index for c in batch.choices) == [0, 1]
    single = client.completions.create(model=MODEL, prompt="Grass is", max_tokens=3, temperature=0)
    assert [c.text for c in batch.choices if c.index == 1] == [single.choices[0].text]
    ids = client.completions.create(model=MODEL, prompt=[[1, 504, 3384, 314]], max_tokens=2,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 4
    parts = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                     {"type": "text", "text": "of France?"}]}])
    plain = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": "What is the capital\nof France?"}])  # parts join with newlines, as in vLLM
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = full.choices[0].text.strip().split(",")[1].strip() or "5"
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                    temperature=0, stop=[stop])
    assert cut.choices[0].model_extra["stop_reason"] == stop
