"""vLLM's routes without the flags that turn them on, as vLLM answers: GET /load is always
there but reads 0 without --enable-server-load-tracking (vLLM's app state starts the counter at 0
and only load-aware calls move it), and GET /tokenizer_info is not a route without
--enable-tokenizer-info-endpoint (vLLM registers it only then): 404. /invocations needs no flag."""

import json
import time
import urllib.request

import openai
import pytest
from openai.types import Completion

from ..e2e.server import ServerProcess
from .wire import open_unread_stream, read_chunked_to_end

pytestmark = pytest.mark.slow

MODEL = "tiny-defaults"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess("--model", str(tiny_model_factory("llama")), "--served-model-name", MODEL,
                        "--kv-cache-memory", "4MiB")
    yield srv
    assert srv.stop() == 0


def get(server, path):
    try:
        with urllib.request.urlopen(server.url + path, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_load_reads_zero_while_a_request_runs(server):
    # A stream of more bytes than the socket buffers hold (the kernel grows a send buffer to 4
    # MiB), read only after the polls: the request cannot finish before it is read, however
    # fast the machine generates it.
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 400, "n": 24,
            "logprobs": 20, "stream": True, "ignore_eos": True}
    sock = open_unread_stream(server, body)
    try:
        time.sleep(0.5)
        seen = [get(server, "/load") for _ in range(5)]
        received = read_chunked_to_end(sock)
    finally:
        sock.close()
    assert b"data: [DONE]" in received and len(received) > 5_000_000  # it ran while polled
    assert seen == [(200, {"server_load": 0})] * 5


def test_tokenizer_info_is_not_a_route(server):
    status, body = get(server, "/tokenizer_info")
    assert status == 404 and body["error"]["code"] == 404


def test_invocations_needs_no_flag(server):
    sdk = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    out = sdk.post("/invocations", cast_to=Completion,
                   body={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert out.object == "text_completion" and out.usage.completion_tokens == 3
