"""The Responses API's translation onto the chat path, without a model: request fields -> a
chat body, input items -> chat messages, chat answers (whole, and as chunks) -> response
objects and events that the openai SDK's own pydantic models validate strictly, the store's
bound, and the routes' handling of previous_response_id, store, streams and background runs
over a fake chat path."""

import asyncio

import openai.types.responses as sdk
import orjson
import pydantic
import pytest
import uvloop

from pyserve.server.errors import APIError
from pyserve.server.http import Request
from pyserve.server.openai.responses import ResponsesAPI, ResponseStore
from pyserve.server.openai.responses.output import Turn
from pyserve.server.openai.messages import fit_by_dropping_turns, with_allowed_tools, without_oldest_turns
from pyserve.server.openai.responses.items import input_messages, with_answer
from pyserve.server.openai.responses.translate import chat_body, hosted_tools
from pyserve.server.openai.streaming import ChunkStream

EVENT = pydantic.TypeAdapter(sdk.ResponseStreamEvent)
ADD = {"type": "function", "name": "add", "description": "Add", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def refused(body, status=400):
    with pytest.raises(APIError) as info:
        chat_body(body, [])
    assert info.value.status == status
    return info.value


# -- requests -> chat bodies ------------------------------------------------------------------
def test_truncation_drops_the_oldest_exchanges_whole():
    system = {"role": "system", "content": "S"}
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]}
    result = {"role": "tool", "content": "42", "tool_call_id": "c1"}
    first, later = {"role": "user", "content": "Q1"}, {"role": "user", "content": "Q2"}
    answer, last = {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}
    conversation = [system, first, call, result, later, answer, last]
    # no tool result loses its call; the last exchange stays
    assert without_oldest_turns(conversation) == [[system, later, answer, last], [system, last]]
    assert without_oldest_turns([system, last]) == [] and without_oldest_turns([first, call, result]) == []
    # a conversation that opens with the assistant loses everything before a user turn
    assert without_oldest_turns([answer, first, call]) == [[first, call]]
    # the fewest dropped for the rendering to fit, in a handful of renders however long
    renders = []

    def render(messages):
        renders.append(len(messages))
        return [0] * sum(len(m["content"]) for m in messages)
    long = [system] + [m for i in range(200) for m in ({"role": "user", "content": "q" * 10},
                                                        {"role": "assistant", "content": "a" * 10})]
    ids = fit_by_dropping_turns(long, render, lambda ids: len(ids) <= 1001)
    assert len(ids) == 1 + 20 * 50 and len(renders) <= 10  # the last 50 exchanges kept
    assert fit_by_dropping_turns([system, last], render, lambda ids: False) == [0, 0, 0]  # cannot fit


def test_a_string_input_with_instructions_and_sampling_fields():
    chat, conversation = chat_body({"model": "m", "input": "Hi", "instructions": "Be brief.",
                                    "max_output_tokens": 12, "temperature": 0.5, "top_p": 0.9,
                                    "metadata": {"k": "v"}, "user": "u", "store": False,
                                    "truncation": "disabled", "reasoning": None, "include": []}, [])
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert conversation == [{"role": "user", "content": "Hi"}]  # instructions are not carried over
    assert (chat["model"], chat["max_tokens"], chat["temperature"], chat["top_p"]) == ("m", 12, 0.5, 0.9)
    assert "stream" not in chat and "max_output_tokens" not in chat and "metadata" not in chat


def test_items_become_messages():
    items = [{"role": "developer", "content": "Rules."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 2}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "1"},
             {"type": "function_call_output", "call_id": "call_2",
              "output": [{"type": "input_text", "text": "2"}]}]
    assert input_messages(items) == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"}]
    only_call = input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    assert only_call == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_reasoning_items_go_to_the_assistant_turn_they_precede():
    thought = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Sum."}],
               "content": [{"type": "reasoning_text", "text": "1 + 1 is 2."}]}
    call = {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"}
    got = input_messages([{"role": "user", "content": "Add."}, thought, call,
                          {"type": "function_call_output", "call_id": "c", "output": "2"},
                          {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
                          {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "2"}]}])
    assert got[1] == {"role": "assistant", "content": None, "reasoning_content": "1 + 1 is 2.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    assert got[3] == {"role": "assistant", "content": "2", "reasoning_content": "Done."}
    # reasoning no answer follows (vLLM's reading: an assistant turn of its own)
    alone = input_messages([{"role": "user", "content": "Q"}, thought, {"role": "user", "content": "R"}, thought])
    assert [(m["role"], m.get("reasoning_content")) for m in alone] == [
        ("user", None), ("assistant", "1 + 1 is 2."), ("user", None), ("assistant", "1 + 1 is 2.")]
    # a text turn followed by reasoning and a call: the call is the reasoning's own turn
    split = input_messages([{"role": "assistant", "content": "Let me see."}, thought, call])
    assert [m.get("reasoning_content") for m in split] == [None, "1 + 1 is 2."]
    for bad in ({**thought, "encrypted_content": "gAAA"}, {**thought, "content": [{"type": "text", "text": "x"}]}):
        with pytest.raises(APIError) as info:
            input_messages([bad])
        assert info.value.param == "input"


def test_a_continued_message_keeps_its_answer_as_its_own_rest():
    conversation = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    output = [{"type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": " three."}]}]
    assert with_answer(conversation, output, True) == [
        {"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two, three."}]
    assert with_answer(conversation, output, False)[2:] == [{"role": "assistant", "content": " three."}]


def test_an_incomplete_last_assistant_message_is_continued():
    partial = {"type": "message", "role": "assistant", "status": "incomplete",
               "content": [{"type": "output_text", "text": "One, two,"}]}
    got, _ = chat_body({"input": [{"role": "user", "content": "Count."}, partial]}, [])
    assert (got["add_generation_prompt"], got["continue_final_message"]) == (False, True)
    done, _ = chat_body({"input": [{"role": "user", "content": "Count."}, {**partial, "status": "completed"}]}, [])
    assert "continue_final_message" not in done
    # one still in_progress is continued too (vLLM's reading)
    going, _ = chat_body({"input": [{"role": "user", "content": "Count."}, {**partial, "status": "in_progress"}]}, [])
    assert going["continue_final_message"] is True


def test_a_forced_call_takes_no_text_format_and_max_tool_calls_is_echoed():
    """The Agents SDK sends its output_type's schema with every turn, tool turns included:
    a turn that must call a tool answers with the call, the format is for the message later."""
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}
    for choice in ("required", {"type": "function", "name": "add"},
                   {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]}):
        chat, _ = chat_body({"input": "x", "tools": [ADD], "tool_choice": choice, "text": fmt}, [])
        assert "response_format" not in chat and chat["tool_choice"]
    for choice in ("auto", "none", None):
        chat, _ = chat_body({"input": "x", "tools": [ADD], "tool_choice": choice, "text": fmt}, [])
        assert chat["response_format"]["type"] == "json_schema"
    assert turn(max_tool_calls=3).from_completion(completion({"content": "A."}))["max_tool_calls"] == 3
    assert refused({"input": "x", "max_tool_calls": 0}).param == "max_tool_calls"


def test_hosted_tools_are_left_out_of_the_prompt():
    """Codex's request: function tools and a namespace beside web_search; the hosted tools
    (namespace members too) are left out, as vLLM leaves them out, the others kept in order."""
    crm = {"type": "namespace", "name": "crm", "tools": [{**ADD, "name": "lookup"},
                                                        {"type": "file_search"}]}
    tools = [ADD, {"type": "web_search", "external_web_access": False}, crm,
             {"type": "mcp", "server_label": "m", "server_url": "http://x"}]
    chat, _ = chat_body({"input": "x", "tools": tools}, [])
    assert [t["function"]["name"] for t in chat["tools"]] == ["add", "crm__lookup"]
    assert hosted_tools(tools) == ["web_search", "file_search", "mcp"]
    only_hosted, _ = chat_body({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "auto"}, [])
    assert "tools" not in only_hosted and "tool_choice" not in only_hosted
    allowed, _ = chat_body({"input": "x", "tools": tools, "tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}, {"type": "function", "name": "add"}]}}, [])
    assert allowed["tool_choice"]["allowed_tools"]["tools"] == [{"type": "function", "function": {"name": "add"}}]


def test_namespace_tools_are_flat_chat_functions_named_back():
    """The Agents SDK's tool_namespace(): each function is namespace__name on the chat path
    (vLLM's flat names), and its calls come back named with their namespace."""
    crm = {"type": "namespace", "name": "crm", "description": "CRM tools",
           "tools": [{**ADD, "name": "lookup"}]}
    chat, _ = chat_body({"input": "x", "tools": [ADD, crm], "tool_choice": "required"}, [])
    assert [t["function"]["name"] for t in chat["tools"]] == ["add", "crm__lookup"]
    assert refused({"input": "x", "tools": [{**crm, "tools": [{"type": "custom", "name": "c"}]}]}).param == "tools"
    call = {"id": "call_1", "type": "function", "function": {"name": "crm__lookup", "arguments": "{}"}}
    out = turn(tools=[ADD, crm]).from_completion(completion({"content": None, "tool_calls": [call]}))
    item = sdk.Response.model_validate(out).output[0]
    assert (item.type, item.name, item.namespace) == ("function_call", "lookup", "crm")
    events, done = run_events(turn(tools=[crm]), [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "crm__lookup", "arguments": "{}"}}]}, "tool_calls")])
    added = [EVENT.validate_python(e) for e in events if e["type"] == "response.output_item.added"]
    assert (added[0].item.name, added[0].item.namespace) == ("lookup", "crm")
    # chosen by its qualified name (the Agents SDK's), alone or among allowed tools
    chat, _ = chat_body({"input": "x", "tools": [crm], "tool_choice": {"type": "function", "name": "crm.lookup"}}, [])
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "crm__lookup"}}
    chat, _ = chat_body({"input": "x", "tools": [crm], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "crm.lookup"}]}}, [])
    assert chat["tool_choice"]["allowed_tools"]["tools"] == [{"type": "function", "function": {"name": "crm__lookup"}}]
    # sent back, the call is the flat chat name again
    assert input_messages([out["output"][0]])[0]["tool_calls"][0]["function"]["name"] == "crm__lookup"


def test_reasoning_context_and_mode():
    history = [{"role": "user", "content": "Q1"},
               {"role": "assistant", "content": "A1", "reasoning_content": "Because."}]
    for context, kept in (("current_turn", False), ("all_turns", True), ("auto", True), (None, True)):
        chat, conversation = chat_body({"input": "Q2", "reasoning": {"context": context}}, history)
        assert ("reasoning_content" in chat["messages"][1]) is kept
        assert conversation[1]["reasoning_content"] == "Because."  # the stored turns keep it
    assert refused({"input": "x", "reasoning": {"mode": "pro"}}).param == "reasoning"
    assert refused({"input": "x", "reasoning": {"context": "some"}}).param == "reasoning"
    echo = turn(reasoning={"effort": "low", "context": "current_turn", "mode": "standard"}).from_completion(
        completion({"content": "A."}))["reasoning"]
    assert echo == {"effort": "low", "summary": None, "context": "current_turn", "mode": "standard"}


def test_allowed_tools_show_and_hold_only_the_named_tools():
    """Turned into the chat form, which the chat path reads and checks (with_allowed_tools)."""
    other = {**ADD, "name": "sub"}
    chat, _ = chat_body({"input": "x", "tools": [ADD, other], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "sub"}]}}, [])
    assert chat["tool_choice"] == {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "sub"}}]}}
    seen = with_allowed_tools(chat)
    assert [t["function"]["name"] for t in seen["tools"]] == ["sub"] and seen["tool_choice"] == "required"
    for bad in ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "mul"}]},
                {"type": "allowed_tools", "mode": "sometimes", "tools": []},
                {"type": "allowed_tools", "mode": "auto", "tools": ["add"]}):
        chat, _ = chat_body({"input": "x", "tools": [ADD], "tool_choice": bad}, [])
        with pytest.raises(APIError) as info:
            with_allowed_tools(chat)
        assert info.value.param == "tool_choice"
    # hosted tools alone allowed: nothing the model can call ("required": a 400, below)
    hosted = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "mcp", "server_label": "x"}]}
    assert chat_body({"input": "x", "tools": [ADD], "tool_choice": hosted}, [])[0]["tool_choice"] == "none"
    refusal = input_messages([{"type": "message", "role": "assistant",
                               "content": [{"type": "refusal", "refusal": "No."}]}])
    assert refusal == [{"role": "assistant", "content": "No."}]


def test_history_comes_first():
    history = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
    chat, conversation = chat_body({"input": "3", "instructions": "I"}, history)
    assert [m["content"] for m in chat["messages"]] == ["I", "1", "2", "3"]
    assert [m["content"] for m in conversation] == ["1", "2", "3"]
    assert len(history) == 2


def test_tools_tool_choice_and_text_format():
    chat, _ = chat_body({"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "add"},
                         "parallel_tool_calls": False}, [])
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "add", "description": "Add", "parameters": ADD["parameters"], "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert chat["parallel_tool_calls"] is False
    for choice in ("auto", "none", "required"):
        assert chat_body({"input": "x", "tools": [ADD], "tool_choice": choice}, [])[0]["tool_choice"] == choice
    assert "tool_choice" not in chat_body({"input": "x", "tool_choice": "auto"}, [])[0]  # no tools
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    chat, _ = chat_body({"input": "x", "text": {"format": {"type": "json_schema", "name": "N",
                                                           "schema": schema, "strict": True}}}, [])
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "N", "schema": schema, "strict": True}}
    assert chat_body({"input": "x", "text": {"format": {"type": "json_object"}}}, [])[0][
        "response_format"] == {"type": "json_object"}
    assert "response_format" not in chat_body({"input": "x", "text": {"format": {"type": "text"},
                                                                      "verbosity": "low"}}, [])[0]


def test_stream_asks_the_chat_path_for_usage_and_extras_pass_through():
    chat, _ = chat_body({"input": "x", "stream": True, "seed": 3, "top_k": 5,
                         "structured_outputs": {"regex": "a+"}}, [])
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert (chat["seed"], chat["top_k"], chat["structured_outputs"]) == (3, 5, {"regex": "a+"})
    assert chat["include_reasoning"] is True  # a reasoning item, with --reasoning-parser


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "tools": [{"type": "custom", "name": "patch"}, ADD]}, "tools", "custom"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice",
     "web_search"),
    ({"input": "x", "tools": [ADD, {"type": "mcp", "server_label": "m"}], "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "mcp", "server_label": "m"}]}},
     "tool_choice", "mcp"),
    ({"input": "x", "reasoning": {"effort": "low", "summary": "brief"}}, "reasoning", "summary"),
    ({"input": "x", "reasoning": {"budget": 5}}, "reasoning", "budget"),
    ({"input": "x", "reasoning": "low"}, "reasoning", "object"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs", "20"),
    # vLLM's own ResponsesRequest fields that change the answer
    ({"input": "x", "cache_salt": "s"}, "cache_salt", "cache_salt"),
    ({"input": "x", "enable_response_messages": True}, "enable_response_messages", "enable"),
    ({"input": "x", "previous_input_messages": [{"role": "user", "content": "a"}]},
     "previous_input_messages", "previous"),
    ({"input": "x", "truncation": "middle"}, "truncation", "auto"),
    ({"input": "x", "background": True, "store": False}, "background", "store"),  # vLLM's words
    ({"input": "x", "tool_choice": {"type": "web_search_preview"}, "tools": [ADD]}, "tool_choice",
     "web_search_preview"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "grammar"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text", "schema"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "x", "instructions": ["no"]}, "instructions", "instructions"),
    ({}, "input", "input"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "no message"),
    ({"input": [{"type": "reasoning", "summary": "x"}, {"role": "user", "content": "y"}]}, "input",
     "summary must be a list"),
    ({"input": [{"type": "compaction"}]}, "input", "compaction"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input",
     "input_image"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", "call_id"),
    # OpenAI's (and vLLM's) field types, not echoed back as sent
    ({"input": "x", "metadata": {"n": 1}}, "metadata", "string"),
    ({"input": "x", "metadata": "m"}, "metadata", "object"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata", "512"),
    ({"input": "x", "user": 5}, "user", "user"),
    ({"input": "x", "include": ["bogus"]}, "include", "bogus"),
    ({"input": "x", "stream": True, "stream_options": {"include_usage": True}}, "stream_options",
     "include_obfuscation"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", "text string"),
])
def test_refusals_name_the_field(body, param, words):
    error = refused(body)
    assert error.param == param and words in error.message, error.message


def test_what_the_agents_sdk_sends_is_accepted():
    """openai-agents sends include and tools as lists even when empty, text with only a
    verbosity, and clients turn obfuscation off with stream_options; none of it asks for
    output pyserve lacks."""
    chat, _ = chat_body({"input": "x", "include": [], "tools": [], "text": {"verbosity": "low"},
                         "stream": True, "stream_options": {"include_obfuscation": False},
                         "metadata": {"run": "1"}, "user": "u", "safety_identifier": "s",
                         "prompt_cache_key": "k"}, [])
    assert "tools" not in chat and "response_format" not in chat and chat["stream"] is True
    chat_body({"input": "x", "include": ["reasoning.encrypted_content"]}, [])  # none encrypted here


# -- chat answers -> response objects ---------------------------------------------------------
def completion(message, finish="stop", usage=(7, 3)):
    return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}


def turn(**body):
    return Turn({"input": "x", **body}, {"temperature": 0.7}, "m")


def test_a_completion_becomes_a_response_the_sdk_validates():
    out = turn(tools=[ADD], metadata={"k": "v"}).from_completion(completion(
        {"content": "Adding.", "tool_calls": [{"id": "call_9", "type": "function",
                                                "function": {"name": "add", "arguments": '{"a": 1}'}}]}))
    response = sdk.Response.model_validate(out)  # strict: every required field is there
    assert "output_text" not in out
    assert response.output_text == "Adding." and response.status == "completed"
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    call = response.output[1]
    assert (call.type, call.call_id, call.name, call.arguments) == ("function_call", "call_9", "add", '{"a": 1}')
    assert call.id.startswith("fc_")
    assert response.usage.input_tokens == 7 and response.usage.output_tokens == 3
    assert response.usage.total_tokens == 10 and response.usage.input_tokens_details.cached_tokens == 0
    assert response.temperature == 0.7 and response.tool_choice == "auto" and response.tools[0].name == "add"
    assert response.metadata == {"k": "v"} and response.error is None
    assert response.incomplete_details is None and response.parallel_tool_calls is True


def test_the_echo_fills_what_openai_fills():
    out = turn(text={"verbosity": "low"}, safety_identifier="s", prompt_cache_key="k").from_completion(
        completion({"content": "a"}))
    response = sdk.Response.model_validate(out)
    assert out["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert (response.safety_identifier, response.prompt_cache_key) == ("s", "k")
    assert response.completed_at >= response.created_at
    cut = turn().from_completion(completion({"content": "a"}, "length"))
    assert cut["completed_at"] is None  # only a completed response has one


def test_length_is_incomplete_and_an_empty_answer_is_an_empty_message():
    response = sdk.Response.model_validate(turn(max_output_tokens=3).from_completion(
        completion({"content": "abc"}, "length")))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.max_output_tokens == 3
    empty = sdk.Response.model_validate(turn().from_completion(completion({"content": "", "tool_calls": []})))
    assert empty.output_text == "" and len(empty.output) == 1 and empty.output[0].type == "message"


# -- chat chunks -> events -----------------------------------------------------------------------
def chunk(delta=None, finish=None, usage=None):
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
            **({"usage": usage} if usage else {})}


async def aiter(items):
    for item in items:
        yield item


def run_events(t, chunks):
    async def main():
        it = aiter(chunks)
        first = await anext(it, None)
        done = []
        events = [e async for e in t.events(it, first, done)]
        return events, done
    return uvloop.run(main())


CHUNKS = [chunk({"role": "assistant", "content": ""}), chunk({"content": "Let "}), chunk({"content": "me."}),
          chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                 "function": {"name": "add", "arguments": '{"a"'}}]}),
          chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': 1}'}}]}),
          chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                 "function": {"name": "add", "arguments": '{}'}}]}, "tool_calls"),
          chunk(usage={"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14})]


def test_events_follow_openais_order_and_validate():
    events, done = run_events(turn(), CHUNKS)
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = parsed[-1].response
    assert final.output_text == "Let me." == parsed[6].text
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "Let me."
    args = "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta"
                   and e.output_index == 1)
    assert args == '{"a": 1}' == final.output[1].arguments and final.output[1].call_id == "call_a"
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.usage.output_tokens == 9 and done[0]["id"] == final.id
    assert parsed[0].response.status == "in_progress" and parsed[0].response.output == []
    assert parsed[2].item.content == [] and parsed[2].item.status == "in_progress"


def test_reasoning_is_a_reasoning_item_whole_and_streamed():
    whole = turn().from_completion(completion({"reasoning": "Think.", "content": "Answer."}))
    response = sdk.Response.model_validate(whole)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Think." and response.output[0].summary == []
    assert response.output_text == "Answer."
    cut = turn().from_completion(completion({"reasoning": "Thin", "content": ""}, "length"))
    assert [(o["type"], o["status"]) for o in cut["output"]] == [("reasoning", "incomplete"),
                                                                ("message", "incomplete")]
    events, done = run_events(turn(), [chunk({"role": "assistant", "content": ""}),
                                       chunk({"reasoning": "Thi"}), chunk({"reasoning": "nk."}),
                                       chunk({"content": "Answer."}, "stop")])
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert parsed[6].text == "Think." and parsed[7].part.type == "reasoning_text"
    final = parsed[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "Answer."

    assert final.output[0].content[0].text == "Think." == whole["output"][0]["content"][0]["text"]
    # the stored conversation carries it on as the assistant turn's reasoning_content
    assert input_messages(done[0]["output"], "output") == [
        {"role": "assistant", "content": "Answer.", "reasoning_content": "Think."}]
    # the reasoning's token logprobs are not the answer's
    lp = lambda token: {"content": [{"token": token, "logprob": -1.0, "bytes": None, "top_logprobs": []}]}  # noqa: E731
    thinking, answering = chunk({"reasoning": "Hm."}), chunk({"content": "A"}, "stop")
    thinking["choices"][0]["logprobs"], answering["choices"][0]["logprobs"] = lp("Hm."), lp("A")
    events, done = run_events(turn(), [chunk({"role": "assistant", "content": ""}), thinking, answering])
    assert [t["token"] for t in done[0]["output"][1]["content"][0]["logprobs"]] == ["A"]
    # a continued message keeps both its reasoning and the answer's
    joined = with_answer([{"role": "assistant", "content": "One,", "reasoning_content": "Count."}],
                         done[0]["output"], True)
    assert joined == [{"role": "assistant", "content": "One,A", "reasoning_content": "Count.\nHm."}]

@pytest.mark.parametrize("reasoning", [{"effort": "low", "summary": "auto"}, {"generate_summary": "concise"}])
def test_a_summary_asked_for_is_the_whole_reasoning_whole_and_streamed(reasoning):
    asked = reasoning.get("summary") or reasoning.get("generate_summary")
    whole = sdk.Response.model_validate(turn(reasoning=reasoning).from_completion(
        completion({"reasoning": "Think.", "content": "Answer."})))
    item = whole.output[0]
    assert [(p.type, p.text) for p in item.summary] == [("summary_text", "Think.")]
    assert item.content[0].text == "Think." and whole.reasoning.summary == asked
    events, _ = run_events(turn(reasoning=reasoning), [
        chunk({"role": "assistant", "content": ""}), chunk({"reasoning": "Thi"}),
        chunk({"reasoning": "nk."}), chunk({"content": "Answer."}, "stop")])
    parsed = [EVENT.validate_python(e) for e in events]
    assert [e.type for e in parsed][2:12] == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.reasoning_summary_text.done"]
    assert parsed[2].item.summary == [] and parsed[4].summary_index == 0
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_summary_text.delta") == "Think."
    assert parsed[12].type == "response.reasoning_summary_part.done" and parsed[12].part.text == "Think."
    assert parsed[13].type == "response.output_item.done" and parsed[13].item.summary[0].text == "Think."
    assert parsed[-1].response.output[0].summary[0].text == "Think."
    # without a summary asked for, none is given (the item's content has the reasoning)
    plain = turn(reasoning={"effort": "low"}).from_completion(completion({"reasoning": "T.", "content": "A."}))
    assert plain["output"][0]["summary"] == [] and plain["reasoning"] == {"effort": "low", "summary": None}


def test_reasoning_tokens_come_from_the_chat_usage():
    answer = completion({"reasoning": "Hm.", "content": "A."})
    answer["usage"]["completion_tokens_details"] = {"reasoning_tokens": 2}
    assert turn().from_completion(answer)["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert turn().from_completion(completion({"content": "A."}))["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 0}


def test_truncation_is_echoed():
    assert turn(truncation="auto").from_completion(completion({"content": "A."}))["truncation"] == "auto"
    assert turn().from_completion(completion({"content": "A."}))["truncation"] == "disabled"


def test_streamed_length_and_empty_and_failure():
    events, done = run_events(turn(), [chunk({"role": "assistant", "content": ""}),
                                       chunk({"content": "ab"}, "length")])
    # vLLM's terminal event, the response's own status incomplete
    assert events[-1]["type"] == "response.completed" and done[0]["status"] == "incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert EVENT.validate_python(events[-1]).response.output[0].status == "incomplete"
    events, _ = run_events(turn(), [chunk({"role": "assistant", "content": ""}), chunk({"content": ""}, "stop")])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    events, done = run_events(turn(), [chunk({"content": "a"}), {"error": {"message": "boom", "code": 500}}])
    failed = EVENT.validate_python(events[-1])
    assert failed.type == "response.failed" and failed.response.error.message == "boom" and done == []
    assert failed.response.output[0].status == "incomplete"


# -- the store --------------------------------------------------------------------------------
def test_the_store_is_bounded_and_least_recently_used_goes():
    store = ResponseStore(max_entries=3)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is not None  # r0 is now the most recently used
    store.put({"id": "r3"}, [])
    assert len(store) == 3 and store.get("r1") is None and store.get("r0") is not None
    assert store.delete("r0") and not store.delete("r0") and store.get("r0") is None


def test_a_running_background_response_is_never_evicted_and_joins_the_order_when_it_ends():
    store = ResponseStore(max_entries=2)
    store.put_running({"id": "bg"}, [])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("bg") is not None and store.get("r0") is None and len(store) == 3
    assert store.finish({"id": "bg", "status": "completed"}, ["turn"])
    assert store.get("r1") is None and store.get("bg").conversation == ["turn"] and len(store) == 2
    assert not store.finish({"id": "bg"}, [])  # ended already: nothing changes
    store.put_running({"id": "gone"}, [])
    assert store.delete("gone") and not store.finish({"id": "gone"}, []) and store.get("gone") is None


# -- the routes over a fake chat path ---------------------------------------------------------
class FakeServing:
    model_name = "m"
    defaults: dict = {}

    def __init__(self):
        self.bodies = []
        self.closed = 0  # chat streams that ran to their end or were closed while running
        self.discarded = 0  # chat streams closed, run or not
        self.gate: asyncio.Event | None = None  # set: the stream waits on it after its first chunk

    def check_model(self, model):
        if model not in (None, "", "m"):
            raise APIError(404, f"the model '{model}' does not exist", "model")

    def parse_body(self, request):  # OpenAIServing's: the real JSON reading, this model check
        from pyserve.server.openai.serving import json_object

        body = json_object(request)
        self.check_model(body.get("model"))
        return body

    async def chat_result(self, request, body, fit_max_tokens=False, drop_old_turns=False,
                          report_cached=False):
        self.bodies.append(body)
        if body.get("max_tokens") == 99:
            raise APIError(400, "too long", "max_tokens")
        if not body.get("stream"):
            return completion({"content": f"answer {len(self.bodies)}"})
        serving = self

        async def chunks():
            try:
                for i, c in enumerate([chunk({"role": "assistant", "content": ""}),
                                       chunk({"content": "streamed"}, "stop"),
                                       chunk(usage={"prompt_tokens": 1, "completion_tokens": 1})]):
                    if i == 1 and serving.gate is not None:
                        await serving.gate.wait()
                    yield c
            finally:
                serving.closed += 1
        return ChunkStream(chunks(), {"id": "chatcmpl-x", "model": "m", "prompt_tokens": [1]},
                           self._discard)

    def _discard(self):
        self.discarded += 1


async def answer(handler, target="/x", body=None, response_id=None):
    request = Request("POST" if body is not None else "GET", target, {},
                      orjson.dumps(body) if body is not None else b"")
    request.path_params = {"response_id": response_id} if response_id else {}
    try:
        response = await handler(request)
    except APIError as exc:
        return exc.status, {"param": exc.param, "message": exc.message}
    if hasattr(response, "chunks"):
        return response.status, b"".join([c async for c in response.chunks])
    return response.status, orjson.loads(response.body)


def call(api, method, target, body=None, params=None):
    handler = {"POST": api.create, "GET": api.retrieve, "DELETE": api.delete}[method]
    return asyncio.run(answer(handler, target, body, (params or {}).get("response_id")))


def test_previous_response_id_store_false_get_and_delete():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())
    status, first = call(api, "POST", "/v1/responses", {"input": "one", "instructions": "sys"})
    assert status == 200 and first["output"][0]["content"][0]["text"] == "answer 1"
    status, second = call(api, "POST", "/v1/responses", {"input": "two", "previous_response_id": first["id"],
                                                         "store": False})
    assert [(m["role"], m["content"]) for m in serving.bodies[-1]["messages"]] == [
        ("user", "one"), ("assistant", "answer 1"), ("user", "two")]
    assert second["previous_response_id"] == first["id"] and second["store"] is False
    assert call(api, "GET", "/x", params={"response_id": second["id"]})[0] == 404  # store: false
    assert call(api, "GET", "/x", params={"response_id": first["id"]}) == (200, first)
    assert call(api, "GET", "/x?stream=true", params={"response_id": first["id"]})[0] == 400
    assert call(api, "DELETE", "/x", params={"response_id": first["id"]}) == (
        200, {"id": first["id"], "object": "response", "deleted": True})
    status, error = call(api, "GET", "/x", params={"response_id": first["id"]})
    assert status == 404 and first["id"] in error["message"]
    status, error = call(api, "POST", "/v1/responses", {"input": "x", "previous_response_id": first["id"]})
    assert status == 404 and error["param"] == "previous_response_id"
    assert call(api, "POST", "/v1/responses", {"input": "x", "model": "other"})[0] == 404
    # a chat-path error names the Responses field
    assert call(api, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 99})[1]["param"] == \
        "max_output_tokens"


def test_a_stream_is_sse_with_event_names_stored_at_the_end_and_closes_the_chat_stream():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())
    status, raw = call(api, "POST", "/v1/responses", {"input": "x", "stream": True})
    assert status == 200 and serving.closed == 1
    blocks = [b for b in raw.decode().split("\n\n") if b]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(orjson.loads(data[len("data: "):]))
        assert events[-1]["type"] == name[len("event: "):]
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert call(api, "GET", "/x", params={"response_id": final["id"]}) == (200, final)


def test_a_stream_closed_at_once_still_ends_the_chat_stream():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())

    async def main():
        response = await api.create(Request("POST", "/v1/responses", {},
                                            orjson.dumps({"input": "x", "stream": True})))
        await anext(response.chunks)  # response.created, before any chunk is read
        await response.chunks.aclose()
    asyncio.run(main())
    assert serving.discarded == 1 and serving.closed == 0  # never started, still ended


def sse_events(raw: bytes) -> list[dict]:
    return [orjson.loads(block.split(b"\ndata: ", 1)[1]) for block in raw.split(b"\n\n") if block]


async def settled(api, response_id) -> dict:
    """The stored response once its background run has ended."""
    for _ in range(100):
        status, response = await answer(api.retrieve, response_id=response_id)
        if response["status"] not in ("queued", "in_progress"):
            return response
        await asyncio.sleep(0)
    raise AssertionError(f"{response_id} still {response['status']}")


def test_background_runs_after_the_post_and_a_cancel_ends_its_chat_stream():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())

    async def main():
        status, queued = await answer(api.create, body={"input": "x", "background": True})
        assert status == 200 and queued["status"] == "queued" and queued["background"] is True
        assert queued["output"] == [] and queued["usage"] is None and serving.bodies[-1]["stream"]
        done = await settled(api, queued["id"])
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "streamed"
        sdk.Response.model_validate(done)
        assert (await answer(api.cancel, response_id=queued["id"]))[0] == 400  # ended already
        # the conversation is stored for the next turn
        await answer(api.create, body={"input": "y", "previous_response_id": queued["id"]})
        assert [m["content"] for m in serving.bodies[-1]["messages"]] == ["x", "streamed", "y"]

        serving.gate = asyncio.Event()  # this one stays in progress until cancelled
        _, queued = await answer(api.create, body={"input": "x", "background": True})
        await asyncio.sleep(0)
        status, running = await answer(api.retrieve, response_id=queued["id"])
        assert running["status"] == "in_progress" and serving.closed == 1
        status, error = await answer(api.create, body={"input": "y", "previous_response_id": queued["id"]})
        assert status == 400 and error["param"] == "previous_response_id"
        assert "in_progress" in error["message"]
        status, cancelled = await answer(api.cancel, response_id=queued["id"])
        assert status == 200 and cancelled["status"] == "cancelled" and serving.closed == 2
        sdk.Response.model_validate(cancelled)
        assert await answer(api.cancel, response_id=queued["id"]) == (200, cancelled)  # idempotent
        assert await answer(api.retrieve, response_id=queued["id"]) == (200, cancelled)

        _, plain = await answer(api.create, body={"input": "x"})
        status, error = await answer(api.cancel, response_id=plain["id"])
        assert status == 400 and error["message"] == "Cannot cancel a synchronous response."
        assert (await answer(api.cancel, response_id="resp_nope"))[0] == 404
        status, error = await answer(api.create, body={"input": "x", "background": True, "store": False})
        assert status == 400 and error["param"] == "background"
    asyncio.run(main())


def test_a_background_stream_is_replayed_from_any_sequence_number():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())

    async def main():
        status, raw = await answer(api.create, body={"input": "x", "background": True, "stream": True})
        events = sse_events(raw)
        assert status == 200 and events[-1]["type"] == "response.completed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        response_id = events[0]["response"]["id"]
        assert (await settled(api, response_id)) == events[-1]["response"]
        _, again = await answer(api.retrieve, "/x?stream=true&starting_after=2", response_id=response_id)
        assert sse_events(again) == events[3:]
        for after in ("-4", "x", "²"):
            status, error = await answer(api.retrieve, f"/x?stream=true&starting_after={after}",
                                         response_id=response_id)
            assert status == 400 and error["param"] == "starting_after"
        _, plain = await answer(api.create, body={"input": "x"})
        status, error = await answer(api.retrieve, "/x?stream=true", response_id=plain["id"])
        assert status == 400 and error["param"] == "stream"
    asyncio.run(main())


def test_a_background_run_that_breaks_fails_with_a_terminal_event_and_leaves_the_running_set():
    serving = FakeServing()
    api = ResponsesAPI(serving, ResponseStore())

    async def broken_chunks():
        yield chunk({"role": "assistant", "content": ""})
        raise RuntimeError("boom")

    async def chat_result(request, body, fit_max_tokens=False, drop_old_turns=False,
                          report_cached=False):
        return broken_chunks()

    serving.chat_result = chat_result

    async def main():
        status, raw = await answer(api.create, body={"input": "x", "background": True, "stream": True})
        events = sse_events(raw)
        assert status == 200 and events[-1]["type"] == "response.failed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        response_id = events[0]["response"]["id"]
        done = await settled(api, response_id)
        assert done["status"] == "failed" and "boom" in done["error"]["message"]
        assert not api.store.is_running(response_id)
    asyncio.run(main())


def test_only_the_most_recent_background_streams_keep_their_events(monkeypatch):
    from pyserve.server.openai.responses import background

    monkeypatch.setattr(background, "KEPT_EVENT_LOGS", 1)
    api = ResponsesAPI(FakeServing(), ResponseStore())

    async def main():
        ids = []
        for _ in range(2):
            _, raw = await answer(api.create, body={"input": "x", "background": True, "stream": True})
            ids.append(sse_events(raw)[0]["response"]["id"])
            await settled(api, ids[-1])
        status, error = await answer(api.retrieve, "/x?stream=true", response_id=ids[0])
        assert status == 400 and error["param"] == "stream"
        status, again = await answer(api.retrieve, "/x?stream=true", response_id=ids[1])
        assert status == 200 and sse_events(again)[-1]["type"] == "response.completed"
    asyncio.run(main())


def test_unknown_fields_are_ignored_with_a_log_line_and_effort_reaches_the_chat_path(caplog):
    """As vLLM's request model allows extra fields (and the chat route logs them), an SDK's
    newer field does not break a request; reasoning.effort becomes the chat path's
    reasoning_effort."""
    with caplog.at_level("WARNING", logger="pyserve"):
        chat, _ = chat_body({"input": "x", "frobnicate": 1, "zeta": 2,
                             "reasoning": {"effort": "low", "summary": None}}, [])
    assert "frobnicate, zeta" in caplog.text
    assert "frobnicate" not in chat and chat["reasoning_effort"] == "low"
    caplog.clear()
    with caplog.at_level("WARNING", logger="pyserve"):  # a client's names, shown briefly
        chat_body({"input": "x", "y" * 100_000: 1}, [])
    assert "y" * 40 + "..." in caplog.text and len(caplog.text) < 1000
    assert "reasoning_effort" not in chat_body({"input": "x", "reasoning": {}}, [])[0]


def test_streamed_logprobs_of_held_back_tokens_reach_the_delta_that_carries_their_text():
    """A chunk with logprobs and no text yet (a stop string's prefix, part of a character)
    before the message opens, and the end-of-turn token's at the end: every token's logprobs
    land in the message, as in the whole answer, and each delta carries its text's tokens."""
    def lp(token):
        return {"token": token, "logprob": -1.0, "bytes": None, "top_logprobs": []}

    def with_logprobs(c, *tokens):
        c["choices"][0]["logprobs"] = {"content": [lp(t) for t in tokens]}
        return c

    chunks = [chunk({"role": "assistant", "content": ""}),
              with_logprobs(chunk({}), "Pa"),
              with_logprobs(chunk({"content": "Paris"}), "ris"),
              with_logprobs(chunk({"content": ""}, "stop"), "<end>")]
    events, done = run_events(turn(), chunks)
    deltas = [[t["token"] for t in e["logprobs"]] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [["Pa", "ris"]]
    assert [t["token"] for t in done[0]["output"][0]["content"][0]["logprobs"]] == ["Pa", "ris", "<end>"]
