"""A vLLM user's habits, end to end: `serve MODEL` with VLLM_API_KEY, several keys, the key on
every route over raw sockets, X-Request-Id, and vLLM's validation of stream_options,
prompt_logprobs -1, per-request chat templates, the response role and cached-token usage."""

import socket

import openai
import pytest

from .server import ServerProcess
from .test_server import http_json

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "env-key-123"


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--enable-request-id-headers", "--enable-prompt-tokens-details",
                        "--max-logprobs", "-1", "--response-role", "helper",
                        "--served-model-name", MODEL, command=("serve", str(default_model_dir)),
                        env={"VLLM_API_KEY": KEY})
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def raw_status(server, target: str, headers: str = "") -> int:
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    return int(reply.split()[1])


def test_vllm_api_key_guards_every_route(server, client):
    assert client.models.list().data[0].id == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    for target in ("/v1/models", "//v1/models", "/v1/models/", "/v1/%6Dodels", "/./metrics",
                   "/metrics", "/tokenize", "/detokenize", "/V1/models", "/no/such/route",
                   f"http://127.0.0.1:{server.port}/v1/models", f"/v1/models?api_key={KEY}"):
        assert raw_status(server, target) == 401, target
    assert raw_status(server, "/metrics", f"Authorization: bearer {KEY}\r\n") == 200
    assert raw_status(server, "/metrics", f"Authorization: Basic {KEY}\r\n") == 401
    assert raw_status(server, "/metrics", f"Authorization: Bearer {KEY}\r\n"
                      f"Authorization: Bearer {KEY}\r\n") == 401  # a repeated header
    for target in ("/health", "/ping", "/version"):
        assert raw_status(server, target) == 200, target


def test_several_keys(default_model_dir):
    srv = ServerProcess("--api-key", "alpha", "beta", "--model", str(default_model_dir),
                        "--served-model-name", MODEL,
                        env={"VLLM_API_KEY": "ignored-when-the-flag-is-given"})
    try:
        for key in ("alpha", "beta"):
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
            assert c.models.list().data[0].id == MODEL
        for key in ("gamma", "ignored-when-the-flag-is-given"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0).models.list()
    finally:
        assert srv.stop() == 0


def test_x_request_id_is_the_response_id_and_echoed(server, client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().id == "chatcmpl-trace-42"
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    fresh = raw.headers["x-request-id"]
    assert len(fresh) == 32 and raw.parse().id.startswith("cmpl-")
    # the same id twice at once: both are served (the engine's own ids stay unique)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=4, extra_headers={"X-Request-Id": "same"}),
            range(2)))
    assert [o.id for o in outs] == ["cmpl-same", "cmpl-same"]
    status, body, _ = http_json(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1},
                                headers={"Authorization": f"Bearer {KEY}",
                                         "X-Request-Id": "bad id"})
    assert status == 400 and b"X-Request-Id" in body


def test_stream_options_need_stream(client):
    for create, extra in ((client.completions.create, dict(prompt="Hi")),
                          (client.chat.completions.create,
                           dict(messages=[{"role": "user", "content": "Hi"}]))):
        with pytest.raises(openai.BadRequestError) as exc:
            create(model=MODEL, max_tokens=2, stream_options={"include_usage": True}, **extra)
        assert exc.value.body["param"] == "stream_options"
        assert "stream" in exc.value.body["message"]


def test_prompt_logprobs_minus_one_is_the_whole_vocabulary(client):
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1,
                                    extra_body={"prompt_logprobs": -1})
    positions = out.choices[0].prompt_logprobs
    assert positions[0] is None
    vocab = 49152
    assert all(len(p) >= vocab for p in positions[1:])
    with pytest.raises(openai.BadRequestError) as exc:  # the memory guard
        client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=1,
                                  extra_body={"prompt_logprobs": -1})
    assert exc.value.body["param"] == "prompt_logprobs"


def test_request_chat_template_needs_trust(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body={"chat_template": "{{ 'x' }}"})
    assert "--trust-request-chat-template" in exc.value.body["message"]
    assert exc.value.body["param"] == "chat_template"


def test_response_role_and_continued_role(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=2)
    assert out.choices[0].message.role == "helper"  # --response-role
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "helper"
    cont = client.chat.completions.create(  # no generation prompt: the last message's role goes on
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.choices[0].message.role == "assistant"


def test_cached_prompt_tokens_are_reported(client):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": "Say yes."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.usage.prompt_tokens_details.cached_tokens % 16 == 0
