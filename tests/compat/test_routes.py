"""vLLM's routes beside the APIs, with the flags that turn them on: GET /load with
--enable-server-load-tracking (vllm/entrypoints/serve/utils/api_utils.py, load_aware_call; its
test: tests/entrypoints/openai/test_basic.py::test_server_load), SageMaker's POST /invocations
(vllm/entrypoints/sagemaker/api_router.py) and GET /tokenizer_info with
--enable-tokenizer-info-endpoint (vllm/entrypoints/serve/tokenize/api_router.py; its tests:
tests/entrypoints/openai/test_tokenization.py). Every one sits behind the API key. A real
server over a real socket, through the openai SDK and raw HTTP."""

import http.client
import json
import threading
import time
import urllib.request

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from ..e2e.server import ServerProcess
from .wire import open_unread_stream, read_chunked_to_end

pytestmark = pytest.mark.slow

MODEL = "tiny-routes"
KEY = "route-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")
LONG = 400  # tokens: a couple of seconds of the tiny model on two cores


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess("--model", str(tiny_model_factory("llama")), "--served-model-name", MODEL,
                        "--kv-cache-memory", "4MiB", "--api-key", KEY,
                        "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
                        "--chat-template", TEMPLATE)
    yield srv
    assert srv.stop() == 0


def call(server, method, path, body=None, headers=AUTH, raw: bytes | None = None):
    """(status, parsed JSON or text) over raw HTTP."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(server.url + path, data=data, method=method,
                                     headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def load(server) -> int:
    status, body = call(server, "GET", "/load")
    assert status == 200 and set(body) == {"server_load"}
    return body["server_load"]


def wait_for_load(server, want: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := load(server)) != want:
        assert time.monotonic() < deadline, f"/load stayed {seen}, expected {want}"
        time.sleep(0.005)


def test_every_new_route_needs_the_key(server):
    for method, path, body in (("GET", "/load", None), ("GET", "/tokenizer_info", None),
                               ("POST", "/invocations", {"prompt": "hi", "max_tokens": 1})):
        status, answer = call(server, method, path, body, headers={})
        assert status == 401, path
        assert answer["error"]["code"] == 401
        status, _ = call(server, method, path, body, headers={"authorization": "Bearer wrong"})
        assert status == 401, path
        assert call(server, method, path, body)[0] == 200, path


# -- /load ---------------------------------------------------------------------------------------

def test_load_counts_a_completion_while_it_runs(server):
    """vLLM's test_server_load: 0, then 1 while a long completion runs, then 0."""
    assert load(server) == 0
    result = {}
    worker = threading.Thread(target=lambda: result.update(answer=call(
        server, "POST", "/v1/completions", {"model": MODEL, "prompt": "Give me a long story",
                                            "max_tokens": LONG, "ignore_eos": True})))
    worker.start()
    wait_for_load(server, 1)
    worker.join()
    assert result["answer"][0] == 200
    assert result["answer"][1]["usage"]["completion_tokens"] == LONG
    assert load(server) == 0


# About 6.8 MB of chunks (n = 4 made 1.1 MB): more than the socket buffers hold (the kernel
# grows a send buffer to 4 MiB here), so the answer cannot be written out before it is read,
# however fast the machine generates it
STREAM = {"model": MODEL, "prompt": "Tell a story", "max_tokens": LONG, "ignore_eos": True,
          "stream": True, "n": 24, "logprobs": 20}


def test_a_stream_counts_until_its_last_chunk_is_written(server):
    sock = open_unread_stream(server, STREAM, KEY)
    try:
        wait_for_load(server, 1)
        time.sleep(0.5)
        assert load(server) == 1  # still generating, or its answer unread
        assert b"data: [DONE]" in read_chunked_to_end(sock)
    finally:
        sock.close()
    wait_for_load(server, 0)


def test_a_client_that_goes_away_stops_counting(server):
    sock = open_unread_stream(server, STREAM, KEY)
    wait_for_load(server, 1)
    sock.close()
    wait_for_load(server, 0)


def test_refused_requests_and_other_routes_leave_the_count_at_zero(server):
    status, _ = call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x",
                                                          "max_tokens": 10_000})
    assert status == 400
    status, _ = call(server, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400
    assert call(server, "POST", "/tokenize", {"prompt": "hello"})[0] == 200
    assert load(server) == 0


# -- /invocations --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sdk(server):
    """The openai SDK at the server's root, for /invocations (the SDK posts to any path)."""
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "Paris is the capital of", "max_tokens": 6,
              "temperature": 0, "ignore_eos": True}


def test_invocations_with_messages_is_a_chat_completion(server, sdk):
    answer = sdk.post("/invocations", body=CHAT, cast_to=ChatCompletion)
    direct = sdk.post("/v1/chat/completions", body=CHAT, cast_to=ChatCompletion)
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.choices[0].message.content == direct.choices[0].message.content
    assert answer.usage == direct.usage


def test_invocations_with_prompt_is_a_completion(server, sdk):
    answer = sdk.post("/invocations", body=COMPLETION, cast_to=Completion)
    direct = sdk.post("/v1/completions", body=COMPLETION, cast_to=Completion)
    assert answer.object == "text_completion"
    assert answer.choices[0].text == direct.choices[0].text and answer.usage.completion_tokens == 6


def test_invocations_prefers_chat_as_vllm_does(server):
    """A body with both goes to chat (vLLM tries ChatCompletionRequest first). pyserve's chat
    route refuses the completions field `prompt` by name (vLLM's would ignore it), which shows
    where the body went: the completions route would have named `messages`."""
    status, answer = call(server, "POST", "/invocations", {**CHAT, "prompt": "also here"})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert call(server, "POST", "/v1/completions", {**COMPLETION, "messages": []})[1][
        "error"]["param"] == "messages"


def test_invocations_streams(server):
    request = urllib.request.Request(server.url + "/invocations",
                                     data=json.dumps({**COMPLETION, "stream": True}).encode(),
                                     headers={"content-type": "application/json", **AUTH})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]
                   if json.loads(line[6:])["choices"])
    assert text == call(server, "POST", "/v1/completions", COMPLETION)[1]["choices"][0]["text"]


def test_invocations_with_input_goes_to_embeddings_where_served(server):
    body = {"model": MODEL, "input": "a sentence to embed"}
    embeddings = call(server, "POST", "/v1/embeddings", body)
    status, answer = call(server, "POST", "/invocations", body)
    if embeddings[0] == 404:  # no /v1/embeddings on this server: vLLM's 400
        assert status == 400 and "Cannot find suitable handler" in answer["error"]["message"]
        assert "EmbeddingCompletionRequest" not in answer["error"]["message"]
    else:
        assert (status, answer.get("object")) == (embeddings[0], embeddings[1].get("object"))
        if status == 200:
            assert answer["data"][0]["embedding"] == pytest.approx(
                embeddings[1]["data"][0]["embedding"], abs=1e-6)


def test_invocations_without_a_known_body_is_vllms_400(server):
    status, answer = call(server, "POST", "/invocations", {"model": MODEL, "text": "hello"})
    assert status == 400
    message = answer["error"]["message"]
    assert message.startswith("Cannot find suitable handler for request. Expected one of: ")
    assert "ChatCompletionRequest" in message and "CompletionRequest" in message
    assert call(server, "POST", "/invocations", raw=b"[1, 2]")[0] == 400
    status, answer = call(server, "POST", "/invocations", raw=b"{nope")
    assert status == 400 and "JSON" in answer["error"]["message"]
    assert call(server, "GET", "/invocations")[0] == 405


def test_invocations_passes_on_the_routes_own_400(server):
    status, answer = call(server, "POST", "/invocations", {**COMPLETION, "max_tokens": -1})
    assert status == 400 and answer["error"]["param"] == "max_tokens"


# -- /tokenizer_info -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def info(server) -> dict:
    status, body = call(server, "GET", "/tokenizer_info")
    assert status == 200
    return body


def test_tokenizer_info_basic(info):
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert "vocab_file" not in info and "merges_file" not in info


def test_tokenizer_info_schema_as_vllms(info):
    """vLLM's test_tokenizer_info_schema: each field, when present, has its type."""
    field_types = {"add_bos_token": bool, "add_prefix_space": bool,
                   "clean_up_tokenization_spaces": bool, "split_special_tokens": bool,
                   "bos_token": str, "eos_token": str, "pad_token": str, "unk_token": str,
                   "chat_template": str, "errors": str, "model_max_length": int,
                   "additional_special_tokens": list, "added_tokens_decoder": dict}
    for name, kind in field_types.items():
        if info.get(name) is not None:
            assert isinstance(info[name], kind), name
    # the tiny tokenizer's special tokens, as text (transformers keeps them as AddedToken)
    assert (info["bos_token"], info["eos_token"], info["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert info["added_tokens_decoder"] == {"0": "<pad>", "1": "<s>", "2": "</s>"}


def test_tokenizer_info_carries_the_servers_chat_template(info):
    assert info["chat_template"] == TEMPLATE  # --chat-template wins over the tokenizer's


def test_tokenizer_info_is_consistent_with_tokenize(server, info):
    status, tokens = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello world!"})
    assert status == 200
    assert info["model_max_length"] >= tokens["max_model_len"]


def test_tokenizer_info_answers_head_and_refuses_post(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("HEAD", "/tokenizer_info", headers=AUTH)
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b""
    finally:
        conn.close()
    assert call(server, "POST", "/tokenizer_info", {})[0] == 405
