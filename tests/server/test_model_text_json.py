"""Issue 68, items 1 and 7: model text that decodes to what JSON cannot carry (a lone surrogate
from `\\ud800`, NaN and Infinity from `NaN` and `1e999`) reaches every route as JSON that
strict parsers read, streamed or not, and every stream ends. Before: a 500 unstreamed, and a
stream whose connection task died (`TypeError: str is not valid UTF-8: surrogates not allowed`)
with no end; `{"n": NaN}` arguments.

A tiny random model writes exactly the text a grammar (structured_outputs regex, or a tool
schema's pattern) allows; the server then reads it as any model's. Every answer is read raw and
parsed with orjson, which refuses invalid UTF-8, lone surrogates and NaN alike. A module's
requests go out at once, so the engine batches them: one request's time, not ten."""

import http.client
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from tests.e2e.server import ServerProcess, regex_for
from tests.server.hostile import MODEL, tiny_server

ECHO = {"type": "object", "properties": {"t": {"type": "string"}}}
HERMES = '<tool_call>{"name": "e", "arguments": {"t": "a\\ud800", "n": NaN, "m": -1e999}}</tool_call>'
PYTHONIC = "[e(n=1e999, m=-1e999)]"  # item 7 alone: was {"n": Infinity, "m": -Infinity}
WANT = {"t": "a\ufffd", "n": None, "m": None}
WANT_PYTHONIC = {"n": None, "m": None}
# a forced call's arguments are the grammar's JSON as the model wrote it: a pattern makes it
# write a lone surrogate's escape (xgrammar matches a pattern against the string's JSON text)
LONE = {"type": "object", "properties": {"t": {"type": "string", "pattern": "^\\\\ud800$"}},
        "required": ["t"], "additionalProperties": False}
TIMEOUT_S = 300.0  # a stream that never ends fails here, not by hanging the suite


def post(srv: ServerProcess, path: str, body: dict) -> tuple[int, bytes]:
    """(status, the whole body): a chunked stream is read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", path, orjson.dumps(body), {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def all_at_once(srv: ServerProcess, requests: dict) -> dict:
    with ThreadPoolExecutor(len(requests)) as pool:
        sent = {name: pool.submit(post, srv, path, body) for name, (path, body) in requests.items()}
        return {name: future.result() for name, future in sent.items()}


def chat(text: str, **extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "e"}], "temperature": 0,
        "max_tokens": 200, "tools": [{"type": "function", "function": {"name": "e", "parameters": ECHO}}],
        "structured_outputs": {"regex": regex_for(text)}, **extra}


def responses(**extra) -> tuple[str, dict]:
    return "/v1/responses", {
        "model": MODEL, "input": "e", "temperature": 0, "max_output_tokens": 200, "store": False,
        "tools": [{"type": "function", "name": "e", "parameters": ECHO}],
        "structured_outputs": {"regex": regex_for(HERMES)}, **extra}


def messages(**extra) -> tuple[str, dict]:
    return "/v1/messages", {
        "model": MODEL, "messages": [{"role": "user", "content": "e"}], "temperature": 0,
        "max_tokens": 200, "tools": [{"name": "e", "input_schema": ECHO}],
        "structured_outputs": {"regex": regex_for(HERMES)}, **extra}


def forced_chat() -> tuple[str, dict]:
    path, body = chat("", tools=[{"type": "function", "function": {"name": "lone", "parameters": LONE}}],
                      tool_choice={"type": "function", "function": {"name": "lone"}})
    del body["structured_outputs"]
    return path, body


def forced_messages() -> tuple[str, dict]:
    path, body = messages(tools=[{"name": "lone", "input_schema": LONE}],
                          tool_choice={"type": "tool", "name": "lone"})
    del body["structured_outputs"]
    return path, body


@pytest.fixture(scope="module")
def hermes(tiny_model_factory):
    yield from tiny_server(tiny_model_factory, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def answers(hermes) -> dict:
    return all_at_once(hermes, {
        "chat": chat(HERMES), "chat stream": chat(HERMES, stream=True),
        "responses": responses(), "responses stream": responses(stream=True),
        "messages": messages(), "messages stream": messages(stream=True),
        "forced chat": forced_chat(), "forced messages": forced_messages()})


@pytest.fixture(scope="module")
def pythonic_server(tiny_model_factory):
    yield from tiny_server(tiny_model_factory, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic")


@pytest.fixture(scope="module")
def pythonic(pythonic_server) -> dict:
    return all_at_once(pythonic_server, {"chat": chat(PYTHONIC), "chat stream": chat(PYTHONIC, stream=True)})


def whole(answer: tuple[int, bytes]) -> dict:
    status, body = answer
    assert status == 200, body
    return orjson.loads(body)


def stream(answer: tuple[int, bytes]) -> list:
    """A stream's data lines, each parsed strictly ("[DONE]" as is)."""
    status, body = answer
    assert status == 200, body
    lines = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    return [line.decode() if line == b"[DONE]" else orjson.loads(line) for line in lines]


def streamed_arguments(chunks: list) -> str:
    assert chunks[-1] == "[DONE]" and not any("error" in c for c in chunks[:-1]), chunks[-3:]
    return "".join(d["function"].get("arguments") or "" for c in chunks[:-1] for choice in c["choices"]
                   for d in choice["delta"].get("tool_calls") or [])


@pytest.mark.parametrize("server,want", [("answers", WANT), ("pythonic", WANT_PYTHONIC)])
def test_chat_tool_call_arguments_are_strict_json(server, want, request):
    got = request.getfixturevalue(server)
    [call] = whole(got["chat"])["choices"][0]["message"]["tool_calls"]
    assert orjson.loads(call["function"]["arguments"]) == want
    assert streamed_arguments(stream(got["chat stream"])) == call["function"]["arguments"]


def test_responses_function_call_arguments_are_strict_json(answers):
    [call] = [i for i in whole(answers["responses"])["output"] if i["type"] == "function_call"]
    assert orjson.loads(call["arguments"]) == WANT
    events = stream(answers["responses stream"])
    assert events[-1]["type"] == "response.completed", events[-1]
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == call["arguments"]


def test_messages_tool_use_input_is_strict_json(answers):
    [block] = [b for b in whole(answers["messages"])["content"] if b["type"] == "tool_use"]
    assert block["input"] == WANT
    events = stream(answers["messages stream"])
    assert events[-1]["type"] == "message_stop", events[-1]
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert orjson.loads(partial) == WANT


def test_a_forced_call_written_with_a_lone_surrogate_escape(answers):
    [call] = whole(answers["forced chat"])["choices"][0]["message"]["tool_calls"]
    assert orjson.loads(call["function"]["arguments"]) == {"t": "\ufffd"}
    [block] = [b for b in whole(answers["forced messages"])["content"] if b["type"] == "tool_use"]
    assert block["input"] == {"t": "\ufffd"}  # Messages parses the arguments into its input
