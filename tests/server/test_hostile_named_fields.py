"""Refusals that must name what is wrong, over a real socket against a real server on the tiny
random model (tests/server/hostile.py): an empty allowed_token_ids (vLLM's 400, not "allow
everything"), an embedding dimensions far past the model's, an over-long /rerank or /score
text (its own field, not input), a forced Anthropic tool whose schema cannot be enforced (the
tool named), and an Anthropic tool_result that answers no tool_use of the turn before
(Anthropic's 400). Issue 68, item 8."""

import pytest

from .hostile import MAX_MODEL_LEN, MODEL, MSG, accepted, refused
from .hostile import server  # noqa: F401  (the module's server)

LONG = "word " * (MAX_MODEL_LEN * 2)  # far more tokens than the model's length
CALL = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


def messages(*turns, **fields) -> dict:
    return {"model": MODEL, "max_tokens": 2, "messages": list(turns), **fields}


def result(tool_use_id: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "2"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1, "allowed_token_ids": []}),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSG, "max_tokens": 1, "allowed_token_ids": []}),
])
def test_an_empty_allowed_token_ids_is_vllms_400(server, path, body):
    refused(server, path, body, "allowed_token_ids", "allowed_token_ids is not None and empty!")


def test_dimensions_far_past_the_model_names_dimensions(server):
    refused(server, "/v1/embeddings", {"model": MODEL, "input": "a", "dimensions": 10**9}, "dimensions")
    refused(server, "/v1/embeddings", {"model": MODEL, "input": ["a"] * 64, "dimensions": 10**9},
            "dimensions")


def test_an_over_long_text_names_its_own_field(server):
    message = refused(server, "/rerank", {"model": MODEL, "query": "a", "documents": ["b", LONG]},
                      "documents", "documents[1]", "maximum context length")
    assert "input" not in message
    refused(server, "/v1/rerank", {"model": MODEL, "query": LONG, "documents": ["b"]}, "query", "query")
    refused(server, "/score", {"model": MODEL, "text_1": "a", "text_2": ["b", "c", LONG]},
            "text_2", "text_2[2]")
    # /v1/embeddings names its input by place
    refused(server, "/v1/embeddings", {"model": MODEL, "input": ["a", LONG]}, "input", "input[1]")
    accepted(server, "/rerank", {"model": MODEL, "query": "a", "documents": ["b", LONG],
                                 "truncate_prompt_tokens": 16})


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "bad_tool"}, {"type": "any"}])
def test_a_forced_tool_whose_schema_cannot_be_enforced_is_named(server, choice):
    bad = {"name": "bad_tool", "input_schema": {"type": "no-such-type"}}
    refused(server, "/v1/messages", messages(MSG[0], tools=[ADD, bad], tool_choice=choice), None,
            "bad_tool")
    chat_tool = {"type": "function", "function": {"name": "bad_tool", "parameters": {"type": "no-such-type"}}}
    refused(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MSG, "max_tokens": 2, "tools": [chat_tool],
        "tool_choice": {"type": "function", "function": {"name": "bad_tool"}}}, "tool_choice", "bad_tool")
    # "required" over several tools: the one whose parameters spoil the grammar is named
    add = {"type": "function", "function": {"name": "add", "parameters": ADD["input_schema"]}}
    refused(server, "/v1/chat/completions", {
        "model": MODEL, "messages": MSG, "max_tokens": 2, "tools": [add, chat_tool],
        "tool_choice": "required"}, "tool_choice", "bad_tool")


@pytest.mark.parametrize("turns, where", [
    # no assistant turn before it at all
    ([{"role": "user", "content": [result("toolu_9")]}], "messages[0].content[0]"),
    # the assistant turn before it called another tool
    ([MSG[0], {"role": "assistant", "content": [CALL]},
      {"role": "user", "content": [result("toolu_1"), result("toolu_9")]}], "messages[2].content[1]"),
    # the call was two turns back: it was answered there, and cannot be again
    ([MSG[0], {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [result("toolu_1")]},
      {"role": "assistant", "content": "3"}, {"role": "user", "content": [result("toolu_1")]}],
     "messages[4].content[0]"),
])
def test_an_orphan_tool_result_is_anthropics_400(server, turns, where):
    none = {"type": "none"}
    refused(server, "/v1/messages", messages(*turns, tools=[ADD], tool_choice=none), None, where,
            "tool_use")
    refused(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": turns, "tools": [ADD],
                                                  "tool_choice": none}, None, where)


def test_tool_results_that_answer_the_turn_before_are_accepted(server):
    # consecutive assistant messages are one turn, as are consecutive user messages
    second = {**CALL, "id": "toolu_2"}
    accepted(server, "/v1/messages", messages(
        MSG[0], {"role": "assistant", "content": [CALL]}, {"role": "assistant", "content": [second]},
        {"role": "user", "content": [result("toolu_2")]}, {"role": "user", "content": [result("toolu_1")]},
        tools=[ADD], tool_choice={"type": "none"}))
