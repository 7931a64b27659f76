"""vLLM's routes without the flags that turn them on, as vLLM answers: GET /load is always
there but reads 0 without --enable-server-load-tracking (vLLM's app state starts the counter at 0
and only load-aware calls move it), and GET /tokenizer_info is not a route without
--enable-tokenizer-info-endpoint (vLLM registers it only then): 404. /invocations needs no flag."""

import json
import threading
import time
import urllib.request

import openai
import pytest
from openai.types import Completion

from ..e2e.server import ServerProcess

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
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = threading.Event()
    seen = []

    def poll():
        while not done.is_set():
            seen.append(get(server, "/load"))
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        out = client.completions.create(model=MODEL, prompt="A long story:", max_tokens=300,
                                        extra_body={"ignore_eos": True})
    finally:
        done.set()
        poller.join()
    assert out.usage.completion_tokens == 300
    assert len(seen) > 10  # polled while it ran
    assert all(answer == (200, {"server_load": 0}) for answer in seen), set(map(str, seen))


def test_tokenizer_info_is_not_a_route(server):
    status, body = get(server, "/tokenizer_info")
    assert status == 404 and body["error"]["code"] == 404


def test_invocations_needs_no_flag(server):
    sdk = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    out = sdk.post("/invocations", cast_to=Completion,
                   body={"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert out.object == "text_completion" and out.usage.completion_tokens == 3
