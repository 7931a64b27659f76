"""Chat-route fields a real client sends, on a real engine (a tiny random model, no socket): a
generation_config default max_tokens capped at the room the prompt leaves (vLLM's
get_max_tokens), text parts of other APIs' types, tool_choice allowed_tools, and OpenAI fields
that change the answer refused by name."""

import orjson
import pytest
import uvloop

from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.server.app import ServerState, _build_routes
from pyserve.server.http import Request
from pyserve.server.openai.messages import template_messages

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
SUB = {"type": "function", "function": {"name": "sub", "parameters": {  # short calls: enums
    "type": "object", "properties": {"b": {"enum": [1, 2]}}, "required": ["b"],
    "additionalProperties": False}}}
LONG = [{"role": "user", "content": "one two three four five six seven eight nine ten"}]


@pytest.fixture(scope="module")
def ask(tiny_model_factory):
    """POST a body to a path of a server on a 256-token model whose generation defaults ask for
    300 new tokens."""
    config = Config.from_flat(model=str(tiny_model_factory("llama")), kv_cache_memory="16MiB",
                              max_model_len=256, generation_config="vllm",
                              override_generation_config={"max_new_tokens": 300})
    state = ServerState(config)
    state.engine = AsyncEngine(EngineCore(config))
    state.router = _build_routes(state, state.engine)
    state.phase = "ready"
    loop = uvloop.new_event_loop()
    loop.run_until_complete(_start(state.engine))

    def post(path: str, body: dict) -> tuple[int, dict]:
        response = loop.run_until_complete(state.handle(Request("POST", path, {}, orjson.dumps(body))))
        return response.status, orjson.loads(response.body)
    yield post
    loop.run_until_complete(state.engine.shutdown())
    loop.close()


async def _start(engine):
    engine.start()


def test_a_default_max_tokens_is_capped_at_the_room_the_prompt_leaves(ask):
    status, out = ask("/v1/chat/completions", {"messages": LONG, "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    usage = out["usage"]
    assert out["choices"][0]["finish_reason"] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
    # a limit the client sets is still refused when it does not fit, as vLLM refuses it
    status, out = ask("/v1/chat/completions", {"messages": LONG, "max_tokens": 250})
    assert status == 400 and out["error"]["param"] == "max_tokens"


def test_text_parts_of_other_apis_types_read_as_text():
    plain = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    for parts in ([{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "b"}],
                  [{"type": "input_text", "text": "a"}, "b"]):
        assert template_messages({"messages": [{"role": "assistant", "content": parts}]}) == \
            template_messages({"messages": plain})


def test_allowed_tools_show_and_hold_only_the_named_tools(ask):
    choice = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "sub"}}]}}
    status, out = ask("/v1/chat/completions", {"messages": LONG[:1], "tools": [ADD, SUB],
                                               "tool_choice": choice, "temperature": 0})
    assert status == 200, out
    calls = out["choices"][0]["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} == {"sub"}, (out["choices"], out["usage"])
    for bad in ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                    {"type": "function", "function": {"name": "mul"}}]}},
                {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}):
        status, out = ask("/v1/chat/completions", {"messages": LONG[:1], "tools": [ADD], "tool_choice": bad})
        assert status == 400 and out["error"]["param"] == "tool_choice", out


@pytest.mark.parametrize("extra,param", [
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation")])
def test_fields_that_would_change_the_answer_are_refused(ask, extra, param):
    status, out = ask("/v1/chat/completions", {"messages": LONG[:1], "max_tokens": 2, **extra})
    assert status == 400 and out["error"]["param"] == param


def test_fields_that_change_nothing_and_every_reasoning_effort_are_accepted(ask):
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        status, out = ask("/v1/chat/completions", {
            "messages": LONG[:1], "max_tokens": 2, "reasoning_effort": effort,
            "prompt_cache_key": "k", "safety_identifier": "s", "prompt_cache_retention": "24h"})
        assert status == 200, (effort, out)
    status, out = ask("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 400 and "function_call" in out["error"]["message"]


def test_default_chat_template_kwargs_under_the_requests(tiny_model_factory):
    """--default-chat-template-kwargs: every request's template starts from them; a request's
    own chat_template_kwargs win, key by key."""
    config = Config.from_flat(model=str(tiny_model_factory("llama")), kv_cache_memory="16MiB",
                              chat_template="{{ greeting }}|{{ mood }}|{% for m in messages %}"
                                            "{{ m.content }}{% endfor %}",
                              default_chat_template_kwargs={"greeting": "hello", "mood": "calm"})
    state = ServerState(config)
    state.engine = AsyncEngine(EngineCore(config))
    state.router = _build_routes(state, state.engine)
    state.phase = "ready"

    def rendered(body: dict) -> str:
        request = Request("POST", "/tokenize", {}, orjson.dumps(
            {"messages": [{"role": "user", "content": "x"}], **body}))
        tokens = orjson.loads(uvloop.run(state.handle(request)).body)["tokens"]
        return state.engine.tokenizer.decode(tokens)
    assert rendered({}).startswith("hello|calm|x")
    assert rendered({"chat_template_kwargs": {"mood": "glad"}}).startswith("hello|glad|x")


@pytest.mark.parametrize("field,value", [
    ("repetition_detection", {"max_pattern_size": 4}),
    ("logprob_token_ids", [1, 2]), ("return_prompt_text", True), ("watermarking", {"key": 1}),
    ("media_io_kwargs", {"image": {}}), ("ec_transfer_params", {"a": 1}), ("tools", []),
])
def test_newer_vllm_fields_that_change_the_answer_are_refused_by_name(ask, field, value):
    status, out = ask("/v1/chat/completions", {"messages": LONG, "max_tokens": 2, field: value})
    assert status == 400 and out["error"]["param"] == field, out


def test_a_thinking_budget_without_a_reasoning_parser_is_refused_by_name(ask):
    """It is enforced with --reasoning-parser (tests/e2e/test_thinking_budget.py)."""
    status, out = ask("/v1/chat/completions", {"messages": LONG, "max_tokens": 2,
                                               "thinking_token_budget": 16})
    assert status == 400 and out["error"]["param"] == "thinking_token_budget", out
    assert "--reasoning-parser" in out["error"]["message"]


def test_fields_that_change_nothing_are_taken(ask):
    for body in ({"session_id": "s", "stream_interval": 4, "return_token_offsets": True},
                 {"stream_options": {}}, {"thinking_token_budget": -1}):
        status, out = ask("/v1/chat/completions", {"messages": LONG, "max_tokens": 2, **body})
        assert status == 200, (body, out)
