"""What the hostile-value tests share: a real server on the tiny random model (one per module)
and a raw HTTP client that sends exact bytes and checks the refusal's shape."""

import http.client
import json
import time

import openai
import orjson
import pytest

from tests.e2e.server import ServerProcess, assert_books_balanced

MODEL = "tiny"
VOCAB = 512  # tools/make_tiny_model.py's VOCAB_SIZE
MAX_MODEL_LEN = 512  # and its max_position_embeddings
# bounds against blow-ups (a refusal takes milliseconds; before the caps, some of these
# bodies held the server for minutes), generous for a loaded CI machine
FAST_S = 10.0
BIG_BODY_S = 45.0  # bodies of tens of MB: sending and parsing them is most of it
MSG = [{"role": "user", "content": "hi"}]


def tiny_server(tiny_model_factory, *flags: str):
    """A server on the tiny random model, for a module-scoped fixture to yield from; at its end
    the server is still up after everything the module sent, every request it accepted ended,
    its KV blocks are all free, and it stops cleanly."""
    srv = ServerProcess("--served-model-name", MODEL, "--enable-debug-endpoints",
                        "--kv-cache-memory", "16MiB", *flags,
                        command=("serve", str(tiny_model_factory("llama"))))
    yield srv
    assert srv.proc.poll() is None, "the server died"
    assert_books_balanced(srv.url)
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """One server per importing module (tiny_server)."""
    yield from tiny_server(tiny_model_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(srv: ServerProcess, path: str, body, timeout: float = 120.0) -> tuple[int, dict, float]:
    """(status, JSON body, seconds): body is bytes as sent, or a value orjson writes (NaN
    cannot be: orjson writes null; send bytes for that)."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        t0 = time.monotonic()
        conn.request("POST", path, raw, {"content-type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        return response.status, json.loads(data), time.monotonic() - t0
    finally:
        conn.close()


def refused(srv: ServerProcess, path: str, body, param: str | None, *words: str,
            within: float = FAST_S) -> str:
    """A 400 in the route's error shape, quickly; OpenAI's names param (when given); the message
    holds each of words. Returns the message."""
    status, answer, seconds = post(srv, path, body)
    assert status == 400, (status, answer)
    assert seconds < within, f"{seconds:.1f}s for a refusal"
    if path.startswith("/v1/messages"):  # Anthropic's shape
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
        message = answer["error"]["message"]
    else:
        assert answer["error"]["type"] == "BadRequestError" and answer["error"]["code"] == 400
        message = answer["error"]["message"]
        if param is not None:
            assert answer["error"]["param"] == param, answer
    for word in words:
        assert word in message, (word, message)
    return message


def accepted(srv: ServerProcess, path: str, body) -> dict:
    status, answer, _ = post(srv, path, body)
    assert status == 200, answer
    return answer
