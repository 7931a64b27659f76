"""A chat choice's text -> OpenAI's message fields, whole and streamed, for each tool mode and
with a reasoning parser: the streamed fragments add up to the whole response."""

import json
import random

import pytest

from pyserve.server.openai.chat_output import ChoiceOutput, merge_delta
from pyserve.server.openai.reasoning import reasoning_parser
from pyserve.server.openai.tool_parsers import tool_parser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]
HERMES = ('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
          '<tool_call>{"name": "g", "arguments": {"y": "z"}}</tool_call>')


def make(mode, **kw):
    parser = tool_parser("hermes", TOOLS) if mode == "auto" else None
    reasoning = reasoning_parser("deepseek_r1") if kw.pop("reasoning", False) else None
    return ChoiceOutput(mode, kw.pop("name", None), parser, reasoning, **kw)


def streamed(output, text, seed=0, reason=None):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    merged = {}
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        merge_delta(merged, output.delta(text[a:b]))
    merge_delta(merged, output.finish(reason))
    calls = {}
    for c in merged.get("tool_calls", []):
        entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
        entry["name"] = c.get("function", {}).get("name") or entry["name"]
        entry["arguments"] += c.get("function", {}).get("arguments", "")
    return merged, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(5))
def test_auto_whole_and_streamed_agree(seed):
    whole = make("auto").whole(HERMES)
    assert whole["content"] == "Sure." and [c["function"]["name"] for c in whole["tool_calls"]] == ["f", "g"]
    out = make("auto")
    merged, calls = streamed(out, HERMES, seed)
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    assert merged.get("content", "").strip() == "Sure."
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    # vLLM's chat route: auto calls make the reason tool_calls even when max_tokens cut the end
    chat = make("auto", calls_end_on_length=True)
    streamed(chat, HERMES, seed)
    assert chat.finish_reason("length") == "tool_calls"
    assert make("auto", calls_end_on_length=True).finish_reason("length") == "length"  # no call


def test_parallel_tool_calls_false_keeps_the_first():
    assert [c["function"]["name"] for c in make("auto", parallel_tool_calls=False).whole(HERMES)["tool_calls"]] == ["f"]
    _, calls = streamed(make("auto", parallel_tool_calls=False), HERMES)
    assert [c["name"] for c in calls] == ["f"]


def test_required_and_named():
    text = json.dumps([{"name": "g", "parameters": {"y": 2}}])
    out = make("required")
    whole = out.whole(text)
    assert whole["content"] == "" and whole["tool_calls"][0]["function"] == {"name": "g", "arguments": '{"y": 2}'}
    assert out.finish_reason("stop") == "tool_calls"
    _, calls = streamed(make("required"), text)
    assert calls == [{"name": "g", "arguments": '{"y": 2}'}]
    # a list cut short (max_tokens) is neither calls nor content, as vLLM answers
    cut = make("required")
    assert cut.whole(text[:-9]) == {"content": "", "tool_calls": []}
    assert cut.finish_reason("length") == "length"
    merged, calls = streamed(make("required"), text[:-9])
    assert calls == [] and not merged.get("content")
    named = make("named", name="f")
    assert named.whole('{"a": 1}')["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert named.finish_reason("stop") == "stop"  # OpenAI's for a named function
    _, calls = streamed(make("named", name="f"), '{"a": 1}')
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}]


def test_a_required_calls_name_decoded_to_a_lone_surrogate_is_written():
    # found by tests/fuzz/fuzz_model_text.py: orjson refused the name "g\ude00"
    import orjson

    fields = make("required").whole('[{"name": "g\\ude00", "parameters": {"s": "\\ud800"}}]')
    assert fields["tool_calls"][0]["function"] == {"name": "g\ufffd", "arguments": '{"s": "\ufffd"}'}
    orjson.dumps(fields)


@pytest.mark.parametrize("mode", ["named", "required"])
def test_a_forced_call_cut_by_max_tokens_is_no_call(mode):
    """vLLM answers a forced call that max_tokens cut with finish_reason "length" and no call;
    a stream holds the call's text until it knows, so nothing of it was sent before."""
    text = '{"a": 1}' if mode == "named" else json.dumps([{"name": "g", "parameters": {"y": 2}}])
    assert make(mode, name="f").whole(text, "length") == {"content": "", "tool_calls": []}
    out = make(mode, name="f")
    assert all(out.delta(piece) == {} for piece in (text[:3], text[3:]))
    assert out.finish("length") == {}
    merged, calls = streamed(make(mode, name="f"), text, reason="stop")
    assert len(calls) == 1 and not merged.get("content")


def test_reasoning_then_tool_calls_and_include_reasoning():
    text = "Let me think.</think>" + HERMES
    whole = make("auto", reasoning=True).whole(text)
    assert whole["reasoning"] == whole["reasoning_content"] == "Let me think."
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["f", "g"]
    merged, calls = streamed(make("auto", reasoning=True), text, seed=3)
    assert merged["reasoning"] == "Let me think." and [c["name"] for c in calls] == ["f", "g"]
    hidden = make("none", reasoning=True, include_reasoning=False)
    assert "reasoning" not in hidden.whole("hmm</think>answer")
    merged, _ = streamed(make("none", reasoning=True, include_reasoning=False), "hmm</think>answer")
    assert "reasoning" not in merged and merged["content"] == "answer"


def test_plain_content_streams_every_piece():
    out = make("none")
    assert out.delta("") == {"content": ""} and out.delta("a") == {"content": "a"}
    assert out.whole("hi") == {"content": "hi", "tool_calls": []}


def test_reasoning_tokens_are_counted_between_the_markers():
    """With the parser's markers as one token each (<think> = 1, </think> = 2 here), the
    reasoning's tokens are counted as vLLM counts them, markers included; usage carries them in
    completion_tokens_details only when they are counted."""
    from pyserve.server.openai.objects import usage

    qwen3 = ChoiceOutput(reasoning_parser=reasoning_parser("qwen3"), reasoning_markers=(1, 2))
    qwen3.count([1, 5, 6])
    qwen3.count([2, 7, 8])  # streamed in two pieces
    assert qwen3.reasoning_tokens == 4
    opened = ChoiceOutput(reasoning_parser=reasoning_parser("deepseek_r1"), reasoning_markers=(1, 2))
    opened.count([5, 6, 2, 7])  # the template opened the reasoning: it starts inside it
    assert opened.reasoning_tokens == 3
    off = ChoiceOutput(reasoning_parser=reasoning_parser("qwen3", enable_thinking=False),
                       reasoning_markers=(1, 2))
    off.count([1, 5, 2, 7])
    assert off.reasoning_tokens == 0
    unmarked = ChoiceOutput(reasoning_parser=reasoning_parser("qwen3"), reasoning_markers=None)
    unmarked.count([1, 5, 2])
    assert unmarked.reasoning_tokens == 0 and unmarked.markers is None
    assert usage(3, 4, None, 2)["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert "completion_tokens_details" not in usage(3, 4, None)


def test_reasoning_left_out_leaves_its_tokens_out():
    """include_reasoning false: the reasoning's token ids (and logprobs) leave the answer too,
    as vLLM hides them, where the parser's markers are one token each."""
    from types import SimpleNamespace

    from pyserve.server.openai.objects import choice

    meta = {"chat": True, "logprobs": None, "return_token_ids": True, "as_token_ids": False,
            "role": "assistant", "chat_echo": None}
    c = SimpleNamespace(token_ids=[1, 5, 2, 7], logprobs=None, text="<think>x</think>A",
                        finish_reason="stop", stop_reason=None)
    hidden = choice(meta, 0, c, True, None, ChoiceOutput(
        reasoning_parser=reasoning_parser("qwen3"), include_reasoning=False, reasoning_markers=(1, 2)))
    assert hidden["token_ids"] == [7] and hidden["message"]["reasoning"] is None
    shown = choice(meta, 0, c, True, None, ChoiceOutput(
        reasoning_parser=reasoning_parser("qwen3"), reasoning_markers=(1, 2)))
    assert shown["token_ids"] == [1, 5, 2, 7] and shown["message"]["reasoning"] == "x"
