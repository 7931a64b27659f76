"""tool_choice "auto" with --tool-call-parser, and --reasoning-parser, end to end through the
openai SDK. A 135M model does not write Hermes tool calls or think tags of its own, so a regex
grammar makes it write exactly such text; the server then parses it like any model's."""

import json

import openai
import pytest

from .server import ServerProcess, regex_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}}]
CALLS = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
         '<tool_call>{"name": "echo", "arguments": {"text": "héllo, \\"world\\""}}</tool_call>')


@pytest.fixture(scope="module")
def hermes(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert srv.stop() == 0


def _ask(client, text, **extra):
    return dict(model=MODEL, messages=[{"role": "user", "content": "Add 12 and 30, then echo."}],
                tools=TOOLS, temperature=0, max_tokens=300,
                extra_body={"structured_outputs": {"regex": regex_for(text)}}, **extra)


def test_auto_finds_the_calls_and_the_content(hermes):
    out = hermes.chat.completions.create(**_ask(hermes, CALLS)).choices[0]
    assert out.finish_reason == "tool_calls"
    assert out.message.content == "Let me add."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in out.message.tool_calls]
    assert calls == [("add", {"a": 12, "b": 30}), ("echo", {"text": 'héllo, "world"'})]
    assert all(c.id.startswith("call_") for c in out.message.tool_calls)


def test_auto_streamed_calls_equal_the_whole_ones(hermes):
    whole = hermes.chat.completions.create(**_ask(hermes, CALLS)).choices[0].message
    content, calls, finish = "", {}, None
    for chunk in hermes.chat.completions.create(**_ask(hermes, CALLS), stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] = d.function.name or entry["name"] if d.function else entry["name"]
            entry["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls" and content.strip() == whole.content
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert len({c["id"] for c in calls.values()}) == 2


def test_auto_without_calls_is_plain_content(hermes):
    out = hermes.chat.completions.create(**_ask(hermes, "Forty-two.")).choices[0]
    assert out.message.content == "Forty-two." and out.message.tool_calls == []
    assert out.finish_reason == "stop"


@pytest.fixture(scope="module")
def reasoning(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    assert srv.stop() == 0


def test_reasoning_goes_to_its_own_field(reasoning):
    text = "The capital is Paris, I am sure.</think>Paris"
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}], temperature=0,
                max_tokens=200, extra_body={"structured_outputs": {"regex": regex_for(text)}})
    message = reasoning.chat.completions.create(**args).choices[0].message
    assert message.content == "Paris"
    assert message.reasoning == message.reasoning_content == "The capital is Paris, I am sure."
    got = {"reasoning": "", "content": ""}
    for chunk in reasoning.chat.completions.create(**args, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            got["reasoning"] += getattr(delta, "reasoning", None) or ""
            got["content"] += delta.content or ""
    assert got == {"reasoning": "The capital is Paris, I am sure.", "content": "Paris"}
