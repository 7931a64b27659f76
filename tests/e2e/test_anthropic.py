"""Anthropic's Messages API end to end: the real `anthropic` SDK over a socket against a
server on the default model. A 135M model writes no tool calls or stop sequences of its own
choosing, so a regex grammar (vLLM's structured_outputs, passed through extra_body) scripts
the text where a test needs exact text; a forced tool's call is made valid by its schema's
grammar."""

import json

import anthropic
import jsonschema
import pytest

from .server import ServerProcess, regex_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "anthropic-test-key"
ASK = [{"role": "user", "content": "Name three colours."}]
# this SDK has no temperature parameter: it goes in the body as an extra field (which the
# server reads as Anthropic's temperature), so answers are greedy and repeatable
GREEDY = {"temperature": 0}
ADD = {"name": "add", "description": "Add two integers.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--api-key", KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    # this SDK sends api_key as "Authorization: Bearer <key>"
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_a_plain_message(client):
    out = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY,
                                 system=[{"type": "text", "text": "You are brief.",
                                          "cache_control": {"type": "ephemeral"}}],
                                 metadata={"user_id": "tester"}, inference_geo="us")
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.id.startswith("msg_")
    assert [b.type for b in out.content] == ["text"] and out.content[0].text.strip()
    assert out.stop_reason in ("end_turn", "max_tokens") and out.stop_sequence is None
    assert out.usage.input_tokens > 0 and 0 < out.usage.output_tokens <= 16
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="You are brief.")
    assert counted.input_tokens == out.usage.input_tokens
    # consecutive user turns are one turn, as Anthropic combines them
    split = [{"role": "user", "content": "Name three"}, {"role": "user", "content": "colours."}]
    joined = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                           {"type": "text", "text": "colours."}]}]
    assert (client.messages.count_tokens(model=MODEL, messages=split).input_tokens
            == client.messages.count_tokens(model=MODEL, messages=joined).input_tokens)


def test_max_tokens_ends_the_message(client):
    out = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 3


def test_a_streamed_message_equals_the_whole(client):
    args = dict(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    kinds = [event.type for event in client.messages.create(**args, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(client):
    args = dict(model=MODEL, max_tokens=40, messages=ASK, stop_sequences=["END", "never"], extra_body={
        **GREEDY, "structured_outputs": {"regex": regex_for("Red, green and blue. END and more")}})
    out = client.messages.create(**args)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "END"
    assert out.content[0].text == "Red, green and blue. "
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Red, green and blue. "
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    plain = client.messages.create(**{**args, "stop_sequences": ["never"]})
    assert plain.stop_reason == "end_turn"
    assert plain.content[0].text == "Red, green and blue. END and more"


def test_a_tool_use_round_trip(client):
    question = [{"role": "user", "content": "What is 12 plus 30? Use the add tool."}]
    args = dict(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[ADD])
    out = client.messages.create(**args, messages=question, tool_choice={"type": "tool", "name": "add"})
    assert out.stop_reason == "tool_use"
    [call] = [b for b in out.content if b.type == "tool_use"]
    assert call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD["input_schema"])
    counted = client.messages.count_tokens(model=MODEL, messages=question, tools=[ADD],
                                           tool_choice={"type": "tool", "name": "add"})
    assert counted.input_tokens == out.usage.input_tokens
    # the same call streamed: its input_json_delta pieces make the same input
    forced = {"type": "tool", "name": "add"}
    with client.messages.stream(**args, messages=question, tool_choice=forced) as s:
        pieces = "".join(e.delta.partial_json for e in s if e.type == "content_block_delta"
                         and e.delta.type == "input_json_delta")
        final = s.get_final_message()
    assert json.loads(pieces) == call.input and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [("add", call.input)]
    # the result goes back; with tool_choice none the answer is text
    answer = client.messages.create(**args, tool_choice={"type": "none"}, messages=[
        *question, {"role": "assistant", "content": out.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"},
                                     {"type": "text", "text": "So what is the answer?"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text


def test_the_key_as_x_api_key(server):
    by_header = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                    default_headers={"Authorization": anthropic.Omit(), "x-api-key": KEY})
    assert by_header.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    for headers in ({"Authorization": anthropic.Omit(), "x-api-key": "wrong"},
                    {"Authorization": anthropic.Omit()}):
        wrong = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                                    default_headers=headers)
        with pytest.raises(anthropic.AuthenticationError) as info:
            wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)
        assert info.value.status_code == 401
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bearer.messages.count_tokens(model=MODEL, messages=ASK)


def _refused(call, status: int, kind: str) -> str:
    with pytest.raises(anthropic.APIStatusError) as info:
        call()
    assert info.value.status_code == status
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_bad_inputs_are_anthropic_errors(client):
    raw = lambda body: client.post("/v1/messages", body=body, cast_to=object)  # noqa: E731
    assert "max_tokens" in _refused(lambda: raw({"model": MODEL, "messages": ASK}), 400,
                                    "invalid_request_error")
    image = {"type": "image",
             "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    message = _refused(lambda: client.messages.create(model=MODEL, max_tokens=4, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]), 400,
        "invalid_request_error")
    assert "image" in message and "text only" in message
    assert "nope" in _refused(lambda: client.messages.create(model="nope", max_tokens=4, messages=ASK),
                              404, "not_found_error")
    assert "nope" in _refused(lambda: client.messages.count_tokens(model="nope", messages=ASK),
                              404, "not_found_error")
    # tools without tool_choice mean "auto", which this server was not started for
    assert "--enable-auto-tool-choice" in _refused(lambda: client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, tools=[ADD]), 400, "invalid_request_error")
    assert "thinking" in _refused(lambda: client.messages.create(
        model=MODEL, max_tokens=64, messages=ASK, thinking={"type": "enabled", "budget_tokens": 32}),
        400, "invalid_request_error")
    assert "mcp_servers" in _refused(lambda: client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, extra_body={"mcp_servers": [{"name": "x"}]}), 400,
        "invalid_request_error")
    # Claude Code's max_tokens 32000 beyond the model length (8,192): vLLM's check and words
    assert _refused(lambda: client.messages.create(model=MODEL, max_tokens=32000, messages=ASK,
                                                   stream=True), 400,
                    "invalid_request_error") == ("max_tokens=32000 cannot be greater than "
                                                 "max_model_len=8192. Please request fewer output tokens.")
    # the stream's refusals come before any event, as HTTP errors
    assert "tool_choice" in _refused(lambda: client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, tools=[ADD], tool_choice={"type": "tool", "name": "sub"},
        stream=True), 400, "invalid_request_error")


def test_server_tools_are_left_out_and_named_in_the_log(server, client):
    """A server tool beside a client tool: the server tool is left out of the prompt and the
    log names the message; a tool_choice that forces it is a 400 naming it."""
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    kw = dict(model=MODEL, max_tokens=40, messages=ASK, tool_choice={"type": "tool", "name": "add"})
    out = client.messages.create(tools=[ADD, web_search], **kw)
    assert [b.type for b in out.content] == ["tool_use"] and out.content[0].name == "add"
    assert client.messages.count_tokens(model=MODEL, messages=ASK, tools=[ADD, web_search]).input_tokens \
        == client.messages.count_tokens(model=MODEL, messages=ASK, tools=[ADD]).input_tokens
    with client.messages.stream(tools=[ADD, web_search], **kw) as stream:
        streamed = stream.get_final_message()
    for message in (out, streamed):
        assert server.logged(f"request {message.id}: hosted tools left out of the prompt (this "
                             "server does not run them): web_search_20250305")
    assert "web_search" in _refused(lambda: client.messages.create(
        **{**kw, "tool_choice": {"type": "tool", "name": "web_search"}}, tools=[ADD, web_search]),
        400, "invalid_request_error")


def test_unknown_fields_are_ignored_as_vllm_ignores_them(client):
    """An SDK's newer field does not break a request (vLLM's request model ignores extras);
    the answer is the one without it."""
    plain = client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                   extra_body={"temperature": 0})
    extra = client.messages.create(model=MODEL, max_tokens=8, messages=ASK,
                                   extra_body={"temperature": 0, "frobnicate": 1, "ignore_eos": False})
    assert extra.content[0].text == plain.content[0].text


def test_structured_output_through_the_sdks_parse(client):
    """messages.parse(output_format=...) sends output_config.format, a JSON schema the answer
    is held to (the chat path's json_schema response format)."""
    from typing import Literal

    import pydantic

    # the SDK drops length and range limits from the schema it sends: enums and booleans
    # bound the answer
    class City(pydantic.BaseModel):
        name: Literal["Paris", "London", "Rome"]
        capital: bool

    parsed = client.messages.parse(model=MODEL, max_tokens=80, output_format=City,
                                   extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(parsed.parsed_output, City)
    assert parsed.stop_reason == "end_turn"
    raw = client.messages.create(model=MODEL, max_tokens=80, extra_body={"temperature": 0}, output_config={
        "format": {"type": "json_schema", "schema": {"type": "object", "properties": {
            "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
        messages=[{"role": "user", "content": "Is Paris in France? Answer as JSON."}])
    assert isinstance(json.loads(raw.content[0].text)["ok"], bool)
    assert "output_config.format" in _refused(lambda: client.messages.create(
        model=MODEL, max_tokens=4, messages=ASK, output_config={"format": {"type": "regex"}}),
        400, "invalid_request_error")


@pytest.fixture(scope="module")
def hermes(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield anthropic.Anthropic(base_url=srv.url, api_key="any", max_retries=0)
    assert srv.stop() == 0


def test_auto_tool_choice_with_a_parser(hermes):
    calls = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    args = dict(model=MODEL, max_tokens=120, messages=ASK, tools=[ADD],
                extra_body={**GREEDY, "structured_outputs": {"regex": regex_for(calls)}})
    out = hermes.messages.create(**args)  # tool_choice absent: "auto", as Anthropic's default
    assert out.stop_reason == "tool_use"
    assert [b.type for b in out.content] == ["text", "tool_use", "tool_use"]
    assert out.content[0].text == "Let me add."
    assert [(b.name, b.input) for b in out.content[1:]] == [("add", {"a": 12, "b": 30}),
                                                            ("add", {"a": 1, "b": 2})]
    assert len({b.id for b in out.content[1:]}) == 2
    with hermes.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].text.strip() == "Let me add."
    assert [(b.name, b.input) for b in final.content[1:]] == [(b.name, b.input) for b in out.content[1:]]
    one = {"type": "auto", "disable_parallel_tool_use": True}
    single = hermes.messages.create(**{**args, "tool_choice": one})
    assert [(b.name, b.input) for b in single.content if b.type == "tool_use"] == [
        ("add", {"a": 12, "b": 30})]


def test_thinking_comes_back_as_a_thinking_block(hermes):
    script = "<think>Twelve and thirty.</think>It is 42."
    args = dict(model=MODEL, max_tokens=2048, messages=ASK,
                extra_body={**GREEDY, "structured_outputs": {"regex": regex_for(script)}})
    thinking = {"type": "enabled", "budget_tokens": 1024}
    out = hermes.messages.create(**args, thinking=thinking)
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[0].thinking == "Twelve and thirty." and out.content[0].signature == "pyserve"
    assert out.content[1].text == "It is 42." and out.stop_reason == "end_turn"
    with hermes.messages.stream(**args, thinking={"type": "adaptive"}) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] \
        == [("thinking", "Twelve and thirty."), ("text", "It is 42.")]
    assert final.content[0].signature == "pyserve"
    # display "omitted": the block with its signature, its text empty, whole and streamed
    hidden = {"type": "adaptive", "display": "omitted"}
    out_hidden = hermes.messages.create(**args, thinking=hidden)
    with hermes.messages.stream(**args, thinking=hidden) as stream:
        final_hidden = stream.get_final_message()
    for answer in (out_hidden, final_hidden):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in answer.content] \
            == [("thinking", None), ("text", "It is 42.")]
        assert answer.content[0].thinking == "" and answer.content[0].signature == "pyserve"
    # without thinking asked for, the reasoning is left out of the answer
    plain = hermes.messages.create(**args)
    assert [(b.type, b.text) for b in plain.content] == [("text", "It is 42.")]
    # the thinking block sent back in the history is accepted
    again = hermes.messages.create(**{**args, "messages": ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in out.content]},
        {"role": "user", "content": "And 1 + 1?"}]})
    assert [(b.type, b.text) for b in again.content] == [("text", "It is 42.")]


def test_claude_codes_roles_system_reminders_and_billing_line(client):
    billing = "x-anthropic-billing-header: cc_version=2.1.200.abc; cc_entrypoint=cli; cch=1234a;"
    system = [{"type": "text", "text": billing}, {"type": "text", "text": "You are brief."}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Agents: none."},
                {"role": "ctx", "content": "Context."}, {"role": "msg", "content": "Name a colour."}]
    clear_thinking = {"edits": [{"type": "clear_thinking_20251015",
                                 "keep": {"type": "thinking_turns", "value": 1}}]}
    out = client.messages.create(model=MODEL, max_tokens=8, messages=messages, system=system,
                                 extra_body={**GREEDY, "context_management": clear_thinking})
    assert out.content[0].type == "text" and out.usage.input_tokens > 0
    # the billing line is not part of the prompt: the count is the same without it
    counted = lambda s: client.messages.count_tokens(model=MODEL, messages=messages, system=s).input_tokens
    assert counted(system) == counted(system[1:]) == out.usage.input_tokens
