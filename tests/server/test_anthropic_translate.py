"""Anthropic's Messages API as a translation onto the chat path, without a model: requests to
chat bodies (and what the chat path's own readers make of them), chat answers and chunks to
messages and events, and the routes over a stand-in for OpenAIServing."""

import asyncio
import json

import orjson
import pytest
import uvloop

from pyserve.server.anthropic import AnthropicServing
from pyserve.server.anthropic import serving as anthropic_serving
from pyserve.server.anthropic.request import chat_body, server_tools, thinking_omitted
from pyserve.server.anthropic.response import MessageEvents, message
from pyserve.server.errors import APIError, anthropic_error_type
from pyserve.server.http import Request, StreamingResponse
from pyserve.server.openai.messages import template_messages, tool_mode
from pyserve.server.openai.streaming import ChunkStream

USER = [{"role": "user", "content": "Hi"}]
ADD = {"name": "add", "description": "Add two integers", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}


def body(**request):
    return chat_body({"model": "m", "max_tokens": 16, "messages": USER, **request})[0]


def refused(request, route="messages"):
    with pytest.raises(APIError) as info:
        chat_body(request, route)
    assert info.value.status == 400
    return info.value


# -- requests ------------------------------------------------------------------------------------
def test_a_plain_request():
    got, stops = chat_body({"model": "m", "max_tokens": 32, "messages": USER, "temperature": 0.5,
                            "top_p": 0.9, "top_k": 40, "metadata": {"user_id": "u"},
                            "service_tier": "auto", "thinking": {"type": "disabled"}})
    assert got == {"model": "m", "messages": USER, "include_reasoning": False, "max_tokens": 32,
                   "temperature": 0.5, "top_p": 0.9, "top_k": 40,
                   "chat_template_kwargs": {"enable_thinking": False}}
    assert stops == []


def test_thinking_sets_the_templates_switch_and_keeps_the_reasoning():
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"},
                     {"type": "adaptive", "display": "summarized"}):
        got = body(max_tokens=2048, thinking=thinking)
        assert got["chat_template_kwargs"] == {"enable_thinking": True} and got["include_reasoning"]
    omitted = body(thinking={"type": "adaptive", "display": "omitted"})
    assert omitted["chat_template_kwargs"] == {"enable_thinking": True}
    assert omitted["include_reasoning"] is True  # the block comes back, its text left out
    assert thinking_omitted({"thinking": {"type": "adaptive", "display": "omitted"}})
    assert not thinking_omitted({"thinking": {"type": "adaptive"}}) and not thinking_omitted({})
    # no thinking field: the template's own default, the reasoning left out
    assert "chat_template_kwargs" not in body() and body()["include_reasoning"] is False
    # the request's own chat_template_kwargs win
    got = body(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True, "x": 1})
    assert got["chat_template_kwargs"] == {"enable_thinking": True, "x": 1}
    counted, _ = chat_body({"messages": USER, "thinking": {"type": "adaptive"}}, "count_tokens")
    assert counted["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.parametrize("thinking,param_message", [
    ({"type": "enabled"}, "thinking.budget_tokens: Field required"),
    ({"type": "enabled", "budget_tokens": 1000}, "thinking.budget_tokens: must be at least 1024"),
    ({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens: must be less than max_tokens"),
    ({"type": "sometimes"}, "thinking: must be"), ("on", "thinking: must be"),
    ({"type": "disabled", "budget_tokens": 2000}, "thinking.budget_tokens: this field"),
    ({"type": "adaptive", "display": "full"}, "thinking.display: must be"),
    ({"type": "enabled", "budget_tokens": "lots"}, "thinking.budget_tokens: must be an integer")])
def test_bad_thinking_is_named(thinking, param_message):
    exc = refused({"max_tokens": 2048, "messages": USER, "thinking": thinking})
    assert exc.param == "thinking" and exc.message.startswith(param_message)


def test_clear_thinking_keeps_the_last_turns_reasoning():
    def turn(n):
        return [{"role": "user", "content": f"Q{n}"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": f"T{n}", "signature": "s"},
                                                  {"type": "text", "text": f"A{n}"}]}]
    history = turn(1) + turn(2) + turn(3) + [{"role": "user", "content": "Q4"}]

    def kept(management):
        got = body(messages=history, context_management=management)["messages"]
        return [m.get("reasoning_content") for m in got if m["role"] == "assistant"]
    clear = {"type": "clear_thinking_20251015"}
    assert kept(None) == ["T1", "T2", "T3"]
    assert kept({"edits": [clear]}) == [None, None, "T3"]  # Anthropic's default: the last turn
    assert kept({"edits": [{**clear, "keep": {"type": "thinking_turns", "value": 2}}]}) == [None, "T2", "T3"]
    assert kept({"edits": [{**clear, "keep": "all"}]}) == ["T1", "T2", "T3"]
    for bad in ({"edits": [{"type": "clear_tool_uses_20250919"}]}, {"edits": "all"},
                {"edits": [{**clear, "keep": {"type": "tool_uses", "value": 1}}]}):
        assert refused({"max_tokens": 2, "messages": history, "context_management": bad}).param == \
            "context_management"


def test_template_kwargs_that_are_no_object_are_named():
    for extra in ({"thinking": {"type": "adaptive"}}, {"output_config": {"effort": "low"}}):
        exc = refused({"max_tokens": 2, "messages": USER, "chat_template_kwargs": "abc", **extra})
        assert exc.param == "chat_template_kwargs"


def test_claude_codes_roles_and_system_messages():
    # ctx and msg are user turns; a system message before any turn joins the system prompt
    got = body(system="S", messages=[{"role": "system", "content": "Also this."},
                                     {"role": "ctx", "content": "C"}, {"role": "msg", "content": "M"}])
    assert got["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "S"}, {"type": "text", "text": "Also this."}]},
        {"role": "user", "content": [{"type": "text", "text": "C"}, {"type": "text", "text": "M"}]}]
    # a system message after a turn: user text where it stands, after that turn's tool results,
    # and the messages before it unchanged (a prefix of what the previous request rendered)
    call = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}}
    history = [{"role": "user", "content": "Add."}, {"role": "assistant", "content": [call]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]}]
    before = body(messages=history)["messages"]
    after = body(messages=history + [{"role": "system", "content": [{"type": "text", "text": "Agents: x"}]},
                                     {"role": "user", "content": "Go on."}])["messages"]
    assert after[:len(before)] == before
    assert after[len(before):] == [{"role": "user", "content": [
        {"type": "text", "text": "Agents: x"}, {"type": "text", "text": "Go on."}]}]
    assert [m["role"] for m in template_messages({"messages": after})] == [
        "user", "assistant", "tool", "user"]
    # after a user turn: joined to it
    got = body(messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}])
    assert got["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": "Be brief."}]}]
    assert refused({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}).param == "messages"


def test_the_billing_header_is_left_out_of_the_prompt():
    line = "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"
    got = body(system=[{"type": "text", "text": line}, {"type": "text", "text": "You are X."}])
    assert got["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "You are X."}]}
    assert body(system=line + "\nYou are X.")["messages"][0]["content"] == [
        {"type": "text", "text": "You are X."}]
    assert body(system=line)["messages"] == USER


def test_thinking_history_and_tool_errors():
    got = body(messages=[
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "opaque"},
                                          {"type": "text", "text": "A"},
                                          {"type": "tool_use", "id": "t", "name": "add", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "boom",
                                      "is_error": True}]}])
    assert got["messages"][1].pop("tool_calls")[0]["id"] == "t"
    assert got["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "A"}],
                                  "reasoning_content": "Hmm."}
    assert got["messages"][2] == {"role": "tool", "tool_call_id": "t", "content": "Error: boom"}
    rendered = template_messages(got)
    assert rendered[1] == {"role": "assistant", "content": "A", "reasoning_content": "Hmm.",
                           "reasoning": "Hmm."}  # both names, as vLLM hands templates them


def test_system_as_a_string_or_text_blocks():
    assert body(system="Be brief.")["messages"][0] == {
        "role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    blocks = [{"type": "text", "text": "One.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Two."}]
    first = body(system=blocks)["messages"][0]
    assert first["content"] == [{"type": "text", "text": "One."}, {"type": "text", "text": "Two."}]
    assert template_messages({"messages": [first]}) == [{"role": "system", "content": "One.\nTwo."}]
    assert body(system="")["messages"] == USER
    assert refused({"max_tokens": 1, "messages": USER, "system": [{"type": "image"}]}).param == "system"


def test_text_blocks_tool_use_and_tool_results_in_order():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Add 2 and 3."}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Adding.", "citations": None},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3},
             "caller": {"type": "direct"}},
            {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": "é", "b": 0}},
            {"type": "tool_use", "id": "toolu_3", "name": "add", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here:"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "bad"}, {"type": "text", "text": "input"}]},
            {"type": "tool_result", "tool_use_id": "toolu_3"},
            {"type": "text", "text": "Go on."}]}]
    got = body(messages=messages, tools=[ADD], tool_choice={"type": "none"})["messages"]
    assert [m["role"] for m in got] == ["user", "assistant", "user", "tool", "tool", "tool", "user"]
    calls = got[1]["tool_calls"]
    assert [c["id"] for c in calls] == ["toolu_1", "toolu_2", "toolu_3"]
    assert calls[0] == {"id": "toolu_1", "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": "é", "b": 0}
    assert got[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}
    assert got[4]["content"] == "Error: bad\ninput" and got[5]["content"] == ""  # is_error: said in the text
    # the chat path reads it: text joined, arguments parsed back for the template
    cleaned = template_messages({"messages": got})
    assert cleaned[1]["content"] == "Adding." and cleaned[2]["content"] == "Here:"
    assert cleaned[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3}
    assert cleaned[6] == {"role": "user", "content": "Go on."}


def test_an_assistant_turn_of_tool_calls_only():
    turn = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}
    got = body(messages=[*USER, turn, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "0"}]}])["messages"]
    assert got[1]["content"] is None and got[1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert template_messages({"messages": got})[1]["content"] == ""


def test_consecutive_turns_of_one_role_are_combined():
    # Anthropic combines consecutive user (or assistant) turns into one turn
    got = body(messages=[*USER, {"role": "user", "content": [{"type": "text", "text": "There"}]},
                         {"role": "assistant", "content": "Hello"},
                         {"role": "assistant", "content": [
                             {"type": "tool_use", "id": "t", "name": "add", "input": {}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                         {"role": "user", "content": "Thanks"}])["messages"]
    assert [m["role"] for m in got] == ["user", "assistant", "tool", "user"]
    assert got[0]["content"] == [{"type": "text", "text": "Hi"}, {"type": "text", "text": "There"}]
    assert got[1]["content"] == [{"type": "text", "text": "Hello"}]
    assert [c["id"] for c in got[1]["tool_calls"]] == ["t"]
    assert template_messages({"messages": got})[0] == {"role": "user", "content": "Hi\nThere"}
    prefill = body(messages=[*USER, {"role": "assistant", "content": "A"},
                             {"role": "assistant", "content": "B"}])
    assert prefill["messages"][1]["content"] == [{"type": "text", "text": "A"},
                                                 {"type": "text", "text": "B"}]
    assert prefill["continue_final_message"] is True


def test_a_final_assistant_message_is_continued():
    got = body(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    assert got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert "continue_final_message" not in body()
    ends_in_a_call = [*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]
    assert refused({"max_tokens": 1, "messages": ends_in_a_call}).param == "messages"


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}])
def test_images_and_documents_are_refused(block):
    exc = refused({"max_tokens": 1, "messages": [{"role": "user", "content": [block]}]})
    assert exc.param == "messages" and "text only" in exc.message
    assert exc.message.startswith("messages[0].content[0]:")
    in_a_result = {"type": "tool_result", "tool_use_id": "t", "content": [block]}
    assert "text only" in refused({"max_tokens": 1, "messages": [
        {"role": "user", "content": [in_a_result]}]}).message


@pytest.mark.parametrize("messages,where", [
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}],
     "messages[0].content[0]"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]}],
     "messages[0].content[0]"),
    ([{"role": "assistant", "content": [{"type": "thinking", "thinking": 3, "signature": "s"}]}],
     "messages[0].content[0].thinking"),
    ([{"role": "developer", "content": "x"}], "messages[0]"),
    ([{"role": "user", "content": [{"type": "web_search_tool_result"}]}], "messages[0].content[0]"),
    ([{"role": "system", "content": "x"}], "messages"),  # no user or assistant turn
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": "x", "name": "me"}], "messages[0].name"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"},
                                   {"type": "text", "text": "x", "extra": 1}]}],
     "messages[0].content[1].extra"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": []}]}],
     "messages[0].content[0].input"),
    ([], "messages")])
def test_malformed_messages(messages, where):
    exc = refused({"max_tokens": 1, "messages": messages})
    assert exc.message.startswith(where + ":") and exc.param == "messages"


def test_max_tokens_is_required():
    exc = refused({"model": "m", "messages": USER})
    assert exc.param == "max_tokens" and exc.message == "max_tokens: Field required"
    assert refused({"max_tokens": 0, "messages": USER}).param == "max_tokens"
    assert refused({"max_tokens": "many", "messages": USER}).param == "max_tokens"
    assert body(max_tokens="8")["max_tokens"] == 8  # read as the chat path reads ints


def test_stop_sequences():
    got, stops = chat_body({"max_tokens": 4, "messages": USER, "stop_sequences": ["END", "\n\n"]})
    assert got["stop"] == ["END", "\n\n"] and stops == ["END", "\n\n"]
    assert "stop" not in body(stop_sequences=[])
    for bad in ("END", [1], [""], ["x"] * 65):
        exc = refused({"max_tokens": 1, "messages": USER, "stop_sequences": bad})
        assert exc.param == "stop_sequences"


def test_tools_and_tool_choice():
    got = body(tools=[ADD, {"name": "now", "input_schema": {"type": "object"}, "type": "custom",
                            "cache_control": {"type": "ephemeral"}}])
    assert got["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": ADD["input_schema"],
                                          "description": "Add two integers"}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    assert "tool_choice" not in got  # the chat path's default with tools: "auto"
    newer = body(tools=[{**ADD, "strict": True, "eager_input_streaming": True, "defer_loading": False,
                         "input_examples": [{"a": 1, "b": 2}]}])["tools"][0]["function"]
    assert newer["strict"] is True
    assert newer["description"] == 'Add two integers\n\nExample inputs:\n{"a": 1, "b": 2}'
    choices = {"auto": "auto", "any": "required", "none": "none"}
    for kind, expected in choices.items():
        assert body(tools=[ADD], tool_choice={"type": kind})["tool_choice"] == expected
    named = body(tools=[ADD], tool_choice={"type": "tool", "name": "add",
                                           "disable_parallel_tool_use": True})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert named["parallel_tool_calls"] is False
    assert body(tools=[ADD], tool_choice={"type": "any", "disable_parallel_tool_use": False}).get(
        "parallel_tool_calls") is None
    # what the chat path makes of them
    mode, tools = tool_mode(named, True, False)
    assert mode == "named" and tools == named["tools"]
    assert tool_mode(body(tools=[ADD], tool_choice={"type": "any"}), True, False)[0] == "required"
    with pytest.raises(APIError) as info:  # "auto" needs --enable-auto-tool-choice
        tool_mode(body(tools=[ADD]), True, False)
    assert info.value.param == "tool_choice"


def test_server_tools_are_left_out_of_the_prompt():
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    got = body(tools=[web, ADD, {"type": "mcp_toolset", "mcp_server_name": "m"}])
    assert [t["function"]["name"] for t in got["tools"]] == ["add"]
    assert server_tools([web, ADD]) == {"web_search": "web_search_20250305"}
    alone = body(tools=[web], tool_choice={"type": "auto"})
    assert "tools" not in alone and "tool_choice" not in alone


@pytest.mark.parametrize("request_fields,param", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}, ADD],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [{"name": "x"}]}, "tools"),
    ({"tools": [{"name": "", "input_schema": {}}]}, "tools"),
    ({"tools": [{"name": "x", "input_schema": {}, "defer_loading": True}]}, "tools"),
    ({"tools": [{"name": "x", "input_schema": {}, "input_examples": [1]}]}, "tools"),
    ({"tools": [{"name": "x", "input_schema": {}, "cache_ttl": 1}]}, "tools"),
    ({"tools": {"name": "x"}}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}}, "tool_choice"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"container": "c"}, "container"),
    ({"output_config": {"effort": "lots"}}, "output_config"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config"),
    ({"output_config": {"verbosity": "low"}}, "output_config"),
    ({"output_config": "json"}, "output_config"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"stop_token_ids": [5]}, "stop_token_ids"),
    ({"guided_regex": "a+"}, "guided_regex"),
    ({"output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_format"),
    ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"stop": ["x"]}, "stop"),
    ({"model": 3}, "model"), ({"stream": "maybe"}, "stream")])
def test_refused_fields_are_named(request_fields, param):
    exc = refused({"max_tokens": 1, "messages": USER, **request_fields})
    assert exc.param == param and exc.message.lstrip("'").startswith(param)


def test_output_config_becomes_a_response_format_and_a_template_variable():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = body(output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert got["response_format"] == {"type": "json_schema",
                                      "json_schema": {"name": "output", "schema": schema}}
    assert got["chat_template_kwargs"] == {"reasoning_effort": "low"}
    # the request's own chat_template_kwargs win
    got = body(output_config={"effort": "high"}, chat_template_kwargs={"reasoning_effort": "low", "x": 1})
    assert got["chat_template_kwargs"] == {"reasoning_effort": "low", "x": 1}


def test_the_betas_output_format_is_output_config_format():
    schema = {"type": "object"}
    assert body(output_format={"type": "json_schema", "schema": schema})["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def test_unknown_fields_are_logged_and_ignored(caplog):
    with caplog.at_level("WARNING", logger="pyserve"):
        got = body(frobnicate=1, zeta={"a": 2})
    assert "frobnicate, zeta" in caplog.text and "frobnicate" not in got


def test_stream_asks_for_usage():
    got = body(stream=True)
    assert got["stream"] is True
    assert got["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream" not in body(stream=False)


def test_pyserve_extras_pass_through():
    got = body(structured_outputs={"regex": "a+"}, seed=3, min_p=0.1, repetition_penalty=1.1)
    assert got["structured_outputs"] == {"regex": "a+"} and got["seed"] == 3
    assert got["min_p"] == 0.1 and got["repetition_penalty"] == 1.1
    assert "metadata" not in body(metadata={"user_id": "u"})
    assert "inference_geo" not in body(inference_geo="us")  # where it runs: here


def test_count_tokens_body():
    got, _ = chat_body({"model": "m", "messages": USER, "system": "S", "tools": [ADD],
                        "tool_choice": {"type": "any"}}, "count_tokens")
    assert got["messages"][0]["role"] == "system" and got["tools"][0]["function"]["name"] == "add"
    assert "max_tokens" not in got and "stream" not in got
    for extra in ({"max_tokens": 5}, {"stream": True}, {"stop_sequences": ["x"]}):
        assert refused({"messages": USER, **extra}, "count_tokens").param == next(iter(extra))
    # what changes nothing on /v1/messages changes nothing here either
    chat_body({"model": "m", "messages": USER, "metadata": {"user_id": "u"}, "service_tier": "auto"},
              "count_tokens")


# -- answers ------------------------------------------------------------------------------------
def chat(content="Hello.", finish="stop", stop_reason=None, calls=()):
    return {"id": "chatcmpl-abc", "object": "chat.completion", "model": "m", "choices": [{
        "index": 0, "finish_reason": finish, "stop_reason": stop_reason, "logprobs": None,
        "message": {"role": "assistant", "content": content, "tool_calls": list(calls)}}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_a_whole_message():
    got = message(chat(), [])
    assert got == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn",
                   "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 3}}


def test_reasoning_is_a_thinking_block_and_cached_tokens_are_cache_reads():
    answer = chat()
    answer["choices"][0]["message"]["reasoning"] = "Think."
    answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 4}
    got = message(answer, [])
    assert got["content"] == [{"type": "thinking", "thinking": "Think.", "signature": "pyserve"},
                              {"type": "text", "text": "Hello."}]
    assert got["usage"] == {"input_tokens": 3, "output_tokens": 3, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4}
    # display "omitted": the block and its signature, no text
    assert message(answer, [], thinking_omitted=True)["content"][0] == {
        "type": "thinking", "thinking": "", "signature": "pyserve"}


def test_stop_reasons():
    assert message(chat(finish="length"), [])["stop_reason"] == "max_tokens"
    got = message(chat(stop_reason="END"), ["END"])
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", "END")
    # a stop token id, or a string that is not one of the request's: a plain end of turn
    assert message(chat(stop_reason=2), ["END"])["stop_reason"] == "end_turn"
    assert message(chat(stop_reason="x"), ["END"])["stop_sequence"] is None
    with pytest.raises(APIError) as info:
        message(chat(finish="abort"), [])
    assert info.value.status == 503


def test_tool_calls_become_tool_use_blocks():
    call = {"id": "call_123", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    got = message(chat(content="", finish="stop", calls=[call]), [])  # a forced tool: "stop" on chat
    assert got["content"] == [{"type": "tool_use", "id": "toolu_123", "name": "add",
                               "input": {"a": 1, "b": 2}}]
    assert got["stop_reason"] == "tool_use"
    got = message(chat(content="Sure.", finish="tool_calls", calls=[call]), [])
    assert [b["type"] for b in got["content"]] == ["text", "tool_use"]
    assert got["stop_reason"] == "tool_use"
    cut = {**call, "function": {"name": "add", "arguments": '{"a": 1, "b'}}
    got = message(chat(content="", finish="length", calls=[cut]), [])
    assert got["content"][0]["input"] == {} and got["stop_reason"] == "max_tokens"


def chunk(delta=None, finish=None, stop_reason=None, usage=None, choices=True):
    out = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                        "stop_reason": stop_reason, "logprobs": None}] if choices else []}
    if usage is not None:
        out["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1],
                        "total_tokens": sum(usage)}
    return out


def run(chunks, stops=(), omitted=False):
    events = MessageEvents(list(stops), omitted)
    out = []
    for c in chunks:
        out += events.feed(c)
        if events.failed:
            return out
    return out + events.close()


def test_a_streamed_text_message():
    events = run([chunk({"role": "assistant", "content": ""}, usage=(7, 0)),
                  chunk({"content": "Hel"}, usage=(7, 1)), chunk({"content": ""}, usage=(7, 1)),
                  chunk({"content": "lo END"}, finish="stop", stop_reason="END", usage=(7, 2)),
                  chunk(choices=False, usage=(7, 2))], ["END"])
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == kind for kind, data in events)
    start = events[0][1]["message"]
    assert start["id"] == "msg_abc" and start["content"] == [] and start["usage"] == {
        "input_tokens": 7, "output_tokens": 0}
    assert events[1][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta") == "Hello END"
    assert events[5][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[5][1]["usage"] == {"input_tokens": 7, "output_tokens": 2}


def test_streamed_thinking_then_text():
    events = run([chunk({"role": "assistant", "content": ""}, usage=(5, 0)),
                  chunk({"reasoning": "Let me ", "reasoning_content": "Let me "}),
                  chunk({"reasoning": "see.", "reasoning_content": "see."}),
                  chunk({"content": "Four."}, finish="stop"), chunk(choices=False, usage=(5, 6))])
    blocks = [(k, d.get("index"), d.get("content_block", d.get("delta", {})).get("type"))
              for k, d in events if k.startswith("content_block")]
    assert blocks == [("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                      ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
                      ("content_block_stop", 0, None), ("content_block_start", 1, "text"),
                      ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None)]
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert "".join(d["delta"].get("thinking", "") for k, d in events if k == "content_block_delta") == "Let me see."
    # display "omitted": the thinking block opens and closes with its signature, no text in it
    hidden = run([chunk({"role": "assistant", "content": ""}, usage=(5, 0)), chunk({"reasoning": "Let me "}),
                  chunk({"content": "Four."}, finish="stop")], omitted=True)
    kinds = [(k, d.get("content_block", d.get("delta", {})).get("type")) for k, d in hidden
             if k.startswith("content_block")]
    assert kinds[:3] == [("content_block_start", "thinking"), ("content_block_delta", "signature_delta"),
                         ("content_block_stop", None)]


def test_streamed_tool_calls():
    events = run([
        chunk({"role": "assistant", "content": ""}, usage=(5, 0)),
        chunk({"content": "Adding."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "add", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1, '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"b": 2}'}},
                              {"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
              finish="tool_calls"),
        chunk(choices=False, usage=(5, 9))])
    starts = [d for k, d in events if k == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "toolu_a", "name": "add", "input": {}}
    assert [s["index"] for s in starts] == [0, 1, 2]
    pieces = {}
    for kind, data in events:
        if kind == "content_block_delta" and data["delta"]["type"] == "input_json_delta":
            pieces[data["index"]] = pieces.get(data["index"], "") + data["delta"]["partial_json"]
    assert {i: json.loads(p) for i, p in pieces.items()} == {1: {"a": 1, "b": 2}, 2: {"a": 3, "b": 4}}
    stops = [d["index"] for k, d in events if k == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_stream_failure_is_an_error_event():
    events = run([chunk({"role": "assistant", "content": ""}, usage=(5, 0)), chunk({"content": "x"}),
                  {"error": {"message": "generation failed: boom", "type": "InternalServerError",
                             "param": None, "code": 500}}])
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: boom"}})
    aborted = run([chunk({"content": "x"}, usage=(5, 1)), chunk(finish="abort")])
    assert aborted[-1][1]["error"]["type"] == "overloaded_error"


def test_error_types():
    assert [anthropic_error_type(s) for s in (400, 401, 404, 413, 429, 500, 503, 405)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
        "rate_limit_error", "api_error", "overloaded_error", "invalid_request_error"]


# -- the routes over a stand-in for OpenAIServing -----------------------------------------------
class FakeServing:
    names = ("m",)

    def __init__(self, result=None, error=None):
        self.result, self.error, self.bodies, self.closed = result, error, [], False
        self.discarded = False

    def _discard(self):
        self.discarded = True

    def check_model(self, model):
        if model not in (None, "") and model not in self.names:
            raise APIError(404, f"the model '{model}' does not exist", "model")

    async def chat_result(self, request, body):
        self.bodies.append(body)
        if self.error is not None:
            raise self.error
        if body.get("stream"):
            return ChunkStream(self._chunks(), {"id": "chatcmpl-abc", "model": "m", "prompt_tokens": [3]},
                               self._discard)
        return self.result

    async def _chunks(self):
        try:
            for c in self.result:
                if isinstance(c, float):  # a pause before the next chunk
                    await asyncio.sleep(c)
                    continue
                yield c
        finally:
            self.closed = True

    async def _chat_prompt(self, body, tools):
        self.bodies.append((body, tools))
        return list(range(11))


def post(handler, payload):
    raw = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return uvloop.run(handler(Request("POST", "/v1/messages", {}, raw)))


def read_stream(response):
    async def drain():
        return b"".join([c async for c in response.chunks])
    return uvloop.run(drain())


def test_route_answers_a_message():
    serving = FakeServing(chat())
    response = post(AnthropicServing(serving).messages, {"model": "m", "max_tokens": 4, "messages": USER})
    assert response.status == 200 and orjson.loads(response.body)["content"][0]["text"] == "Hello."


@pytest.mark.parametrize("payload,status,kind", [
    ({"model": "other", "max_tokens": 4, "messages": USER}, 404, "not_found_error"),
    ({"model": "m", "messages": USER}, 400, "invalid_request_error"),
    (b"{not json", 400, "invalid_request_error"),
    ([1, 2], 400, "invalid_request_error")])
def test_route_refusals_are_anthropic_shaped(payload, status, kind):
    response = post(AnthropicServing(FakeServing(chat())).messages, payload)
    assert response.status == status
    got = orjson.loads(response.body)
    assert got["type"] == "error" and got["error"]["type"] == kind
    assert set(got["error"]) == {"type", "message"}


def test_chat_path_refusals_are_reshaped():
    error = APIError(400, '"auto" tool choice requires --enable-auto-tool-choice', "tool_choice")
    response = post(AnthropicServing(FakeServing(error=error)).messages,
                    {"max_tokens": 4, "messages": USER, "tools": [ADD]})
    assert response.status == 400
    assert orjson.loads(response.body) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": error.message}}
    busy = APIError(429, "the server's queue is full", headers=[("retry-after", "1")])
    response = post(AnthropicServing(FakeServing(error=busy)).messages,
                    {"max_tokens": 4, "messages": USER})
    assert response.status == 429 and ("retry-after", "1") in response.headers
    assert orjson.loads(response.body)["error"]["type"] == "rate_limit_error"


def test_route_streams_events():
    serving = FakeServing([chunk({"role": "assistant", "content": ""}, usage=(3, 0)),
                           chunk({"content": "Hi"}, finish="stop", usage=(3, 1)),
                           chunk(choices=False, usage=(3, 1))])
    response = post(AnthropicServing(serving).messages,
                    {"max_tokens": 4, "messages": USER, "stream": True})
    assert isinstance(response, StreamingResponse) and response.content_type == "text/event-stream"
    raw = read_stream(response).decode()
    frames = [f for f in raw.split("\n\n") if f]
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("message_start") == 1
    for frame, kind in zip(frames, kinds):
        assert json.loads(frame.split("\n")[1].removeprefix("data: "))["type"] == kind
    start = json.loads(frames[0].split("\n")[1].removeprefix("data: "))["message"]
    assert start["id"] == "msg_abc" and start["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert serving.closed and serving.bodies[0]["stream_options"]["include_usage"] is True


def test_a_stream_pings_while_it_waits_and_a_client_leaving_mid_wait_ends_it(monkeypatch):
    monkeypatch.setattr(anthropic_serving, "PING_S", 0.02)
    serving = FakeServing([0.1, chunk({"role": "assistant", "content": ""}, usage=(3, 0)),
                           chunk({"content": "Hi"}, finish="stop", usage=(3, 1))])
    response = post(AnthropicServing(serving).messages, {"max_tokens": 4, "messages": USER, "stream": True})
    kinds = [f.split("\n")[0].removeprefix("event: ") for f in read_stream(response).decode().split("\n\n") if f]
    assert kinds[:2] == ["message_start", "ping"] and kinds.count("ping") >= 3
    assert kinds[-2:] == ["message_delta", "message_stop"]
    # the client goes while the stream waits for its first chunk: the chat stream is ended
    waiting = FakeServing([60.0, chunk({"content": "never"})])
    response = post(AnthropicServing(waiting).messages, {"max_tokens": 4, "messages": USER, "stream": True})

    async def leave_after_three_events():
        events = response.chunks
        for _ in range(3):
            await anext(events)
        await events.aclose()
    uvloop.run(leave_after_three_events())
    assert waiting.closed and waiting.discarded
    # or at once, after message_start: the requests are discarded though no chunk was read
    early = FakeServing([chunk({"content": "never"})])
    response = post(AnthropicServing(early).messages, {"max_tokens": 4, "messages": USER, "stream": True})

    async def leave_at_once():
        await anext(response.chunks)
        await response.chunks.aclose()
    uvloop.run(leave_at_once())
    assert early.discarded and not early.closed


def test_count_tokens_route():
    serving = FakeServing()
    handler = AnthropicServing(serving).count_tokens
    response = post(handler, {"model": "m", "messages": USER, "tools": [ADD]})
    assert response.status == 200 and orjson.loads(response.body) == {"input_tokens": 11}
    rendered_body, tools = serving.bodies[0]
    assert tools == rendered_body["tools"] and tools[0]["function"]["name"] == "add"
    assert post(handler, {"model": "nope", "messages": USER}).status == 404
