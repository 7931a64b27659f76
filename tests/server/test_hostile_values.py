"""Hostile values over a real socket against a real server on the tiny random model: nesting
past any sane depth, million-element arrays, NaN and infinities (as JSON literals, which are
not JSON, and as strings), integers past 64 bits or sane bounds, booleans for ints, token ids
out of the vocabulary, and lists past server/request_limits.py's caps. Each is a 400 in the
route's shape naming the field, fast; the server stays up and its books balance at the end
(tests/server/hostile.py). Chat-shaped hostility is tests/server/test_hostile_chat.py's."""

import json

import openai
import pytest

from pyserve.server import request_limits as limits

from .hostile import BIG_BODY_S, MAX_MODEL_LEN, MODEL, MSG, VOCAB, accepted, post, refused
from .hostile import client, server  # noqa: F401  (the module's server and its openai client)

BIG_INT = "1" + "0" * 30  # a JSON integer past 64 bits (orjson reads it as a float)
C, CHAT, EMB = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
ANTHROPIC, RESPONSES = "/v1/messages", "/v1/responses"


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "a", "max_tokens": 1, **fields}


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


# -- nesting -----------------------------------------------------------------------------------

def test_a_body_nested_100000_deep_is_refused_by_the_parser(server):
    refused(server, C, nested(100_000), None, "nests more than 64 levels")
    refused(server, CHAT, b'{"messages": ' + nested(100_000) + b"}", None, "nests more than")


@pytest.mark.parametrize("path, head, tail", [
    (C, b'{"prompt": "a", "max_tokens": 1, "logit_bias": {"1": ', b"}}"),
    (C, b'{"prompt": ', b', "max_tokens": 1}'),
    (C, b'{"prompt": "a", "max_tokens": 1, "metadata_of_mine": ', b"}"),  # an unknown field too
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": ', b"}}"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tool_choice": "none", "tools": '
     b'[{"type": "function", "function": {"name": "f", "parameters": {"a": ', b"}}}]}"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "x", "schema": {"items": ', b"}}}}"),
    (EMB, b'{"input": ', b"}"),
    (RESPONSES, b'{"input": "hi", "metadata": {"a": ', b"}}"),
    (ANTHROPIC, b'{"max_tokens": 1, "messages": [{"role": "user", "content": ', b"}]}"),
])
def test_values_nested_1000_deep_are_refused_before_anything_recurses(server, path, head, tail):
    # within orjson's own 1024 levels: Python's recursion (reprs, templates, grammar
    # compilers, orjson.dumps of an echoed value) would fail at 1000
    refused(server, path, head + nested(1000) + tail, None, "nests more than 64 levels")


@pytest.mark.parametrize("field", ["guided_json", "structural_tag"])
def test_json_in_a_string_is_held_to_the_same_depth(server, field):
    deep = '{"type": "array", "items": ' * 100_000 + "{}" + "}" * 100_000
    refused(server, C, completion(**{field: deep}), field, "not valid JSON")  # past orjson's 1024
    deep = '{"type": "array", "items": ' * 200 + "{}" + "}" * 200
    refused(server, C, completion(**{field: deep}), field, "nests more than 64 levels")


def test_a_tool_calls_arguments_are_held_to_the_same_depth(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 500 + "]" * 500}}
    body = {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 1}
    refused(server, CHAT, body, "messages", "arguments nests more than 64 levels")


def test_nesting_within_the_cap_is_served(server):
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "integer"}}}}}}
    accepted(server, CHAT, {"messages": MSG, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})


# -- million-element arrays --------------------------------------------------------------------

MILLION = 10**6
# a million objects or arrays: refused before the body is parsed (server/json_size.py), naming
# the field that holds them
OBJECTS = (f"holds more than {limits.MAX_JSON_CONTAINERS:,} JSON objects and arrays",)


@pytest.mark.parametrize("path, body, param, words", [
    (C, lambda: completion(prompt=["a"] * MILLION), "prompt", (f"at most {limits.MAX_PROMPTS} prompts",)),
    (C, lambda: completion(prompt=[[1]] * MILLION), "prompt", OBJECTS),
    (C, lambda: completion(prompt=[1] * MILLION), "max_tokens", ("maximum context length",)),
    (C, lambda: completion(stop=["x"] * MILLION), "stop", (f"at most {limits.MAX_STOP}",)),
    (C, lambda: completion(stop_token_ids=[1] * MILLION), "stop_token_ids", (f"at most {limits.MAX_STOP}",)),
    (C, lambda: completion(logit_bias={str(i): 1 for i in range(MILLION)}), "logit_bias",
     (f"at most {limits.MAX_LOGIT_BIAS}",)),
    (CHAT, lambda: {"messages": [{}] * MILLION}, "messages", OBJECTS),
    (CHAT, lambda: {"messages": [{"role": "user", "content": [{}] * MILLION}]}, "messages", OBJECTS),
    (CHAT, lambda: {"messages": MSG, "tools": [{}] * MILLION, "tool_choice": "none"}, "tools", OBJECTS),
    (EMB, lambda: {"input": [[1]] * MILLION}, "input", OBJECTS),
    (RESPONSES, lambda: {"input": [{}] * MILLION}, "input", OBJECTS),
    (ANTHROPIC, lambda: {"max_tokens": 1, "messages": [{}] * MILLION}, None, OBJECTS),
])
def test_million_element_arrays_are_refused_fast(server, path, body, param, words):
    refused(server, path, body(), param, *words, within=BIG_BODY_S)


# -- NaN and infinities ------------------------------------------------------------------------

@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_non_json_numbers_are_a_400_naming_the_field(server, literal):
    body = b'{"prompt": "a", "max_tokens": 1, "temperature": ' + literal + b"}"
    refused(server, C, body, "temperature", "not valid JSON", "send a finite number")


def test_nan_as_python_json_writes_it_is_a_400_naming_the_field(server, client):
    # Python's json module writes float("nan") as NaN (the SDK's HTTP client refuses to send
    # it; requests and plain json.dumps send it as is)
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1, "top_p": float("nan")})
    refused(server, C, body.encode(), "top_p", "NaN is not a JSON number")
    for name in ("temperature", "top_p", "presence_penalty"):  # as strings, through the SDK
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=MODEL, prompt="a", max_tokens=1, extra_body={name: "NaN"})
        assert exc.value.body["param"] == name and "finite" in exc.value.body["message"]


FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "length_penalty"]


@pytest.mark.parametrize("text", ["NaN", "nan", "Infinity", "-Infinity", "inf", "1e400"])
@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_non_finite_strings_for_float_fields(server, name, text):
    refused(server, C, completion(**{name: text}), name, "finite number")


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-inf"])
def test_non_finite_logit_bias_values(server, text):
    refused(server, C, completion(logit_bias={"5": text}), "logit_bias", "token 5", "finite")


def test_non_finite_strings_on_every_route(server, client):
    refused(server, CHAT, {"messages": MSG, "max_tokens": 1, "min_p": "NaN"}, "min_p", "finite")
    refused(server, RESPONSES, {"input": "hi", "temperature": "NaN"}, "temperature", "finite")
    refused(server, RESPONSES, {"input": "hi", "top_p": "Infinity"}, "top_p", "finite")
    for name in ("temperature", "top_p"):
        message = refused(server, ANTHROPIC, {"max_tokens": 1, "messages": MSG, name: "NaN"}, None)
        assert name in message and "finite" in message
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1,
                                       extra_body={"repetition_penalty": "inf"})
    assert exc.value.body["param"] == "repetition_penalty"


# -- integers ----------------------------------------------------------------------------------

INT_FIELDS = ["max_tokens", "seed", "n", "best_of", "logprobs", "top_k", "min_tokens",
              "truncate_prompt_tokens", "prompt_logprobs", "priority"]
HUGE = [BIG_INT, str(2**63), str(2**64 - 1), str(-2**63 - 1), '"' + "9" * 5000 + '"', "true"]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("name", INT_FIELDS)
def test_int_fields_past_64_bits_or_booleans(server, name, value):
    body = f'{{"prompt": "a", "max_tokens": 1, "{name}": {value}}}'.encode()
    refused(server, C, body, name)


@pytest.mark.parametrize("name", ["max_tokens", "seed", "thinking_token_budget"])
def test_int_text_with_a_separator_int_does_not_strip(server, name):
    # "\x1e" is whitespace to str.isspace and a regex's \s, but int() refuses it (found by
    # tests/fuzz/fuzz_requests.py): a 400 naming the field, not a 500
    body = f'{{"prompt": "a", "max_tokens": 1, "{name}": "5\\u001e"}}'.encode()
    refused(server, C, body, name)


@pytest.mark.parametrize("name, value", [("max_tokens", 2**62), ("n", 2**62), ("best_of", 2**62),
                                         ("logprobs", 2**62), ("min_tokens", 2**62),
                                         ("truncate_prompt_tokens", 2**62),
                                         ("prompt_logprobs", 2**62), ("priority", 2**62)])
def test_int_fields_within_64_bits_but_past_any_sane_bound(server, name, value):
    refused(server, C, completion(**{name: value}), name)


@pytest.mark.parametrize("name", ["max_completion_tokens", "top_logprobs"])
@pytest.mark.parametrize("value", [BIG_INT, str(2**64 - 1), "true", str(2**62)])
def test_chat_int_fields(server, name, value):
    body = f'{{"messages": [{{"role": "user", "content": "hi"}}], "logprobs": true, "{name}": {value}}}'
    # within 64 bits, the engine's limit refuses it (naming max_tokens or logprobs, as vLLM)
    refused(server, CHAT, body.encode(), name if value != str(2**62) else None)


@pytest.mark.parametrize("ids", [[2**63], [2**64 - 1], [True], [1.0], [1.5], [-1], [VOCAB],
                                 [[1], [-1]], [[1], [True]], [[1], [2.0]]])
def test_token_id_prompts_outside_the_vocabulary_or_not_ints(server, client, ids):
    message = refused(server, C, completion(prompt=ids), "prompt")
    assert "token id" in message.lower()
    if ids != [VOCAB] and not isinstance(ids[0], list):
        return
    with pytest.raises(openai.BadRequestError) as exc:  # the same through the SDK
        client.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    assert exc.value.body["param"] == "prompt"


def test_a_prompt_of_ids_past_64_bits_as_parsed(server):
    refused(server, C, b'{"prompt": [1, ' + BIG_INT.encode() + b'], "max_tokens": 1}', "prompt")


@pytest.mark.parametrize("ids", [[-1], [VOCAB], [True], [1.5], [2**64 - 1], [[1], [-5]], [[2], [False]]])
def test_token_id_embedding_inputs(server, ids):
    refused(server, EMB, {"model": MODEL, "input": ids}, "input")


@pytest.mark.parametrize("key", ["9" * 5000, str(2**64), "-1", str(VOCAB), "1.5", "true", ""])
def test_logit_bias_keys(server, key):
    refused(server, C, completion(logit_bias={key: 1}), "logit_bias")


@pytest.mark.parametrize("value", [BIG_INT, str(2**64 - 1), "true", "-1", str(VOCAB), "1.5"])
def test_stop_token_ids(server, value):
    refused(server, C, f'{{"prompt": "a", "max_tokens": 1, "stop_token_ids": [{value}]}}'.encode(),
            "stop_token_ids")


@pytest.mark.parametrize("name", ["allowed_token_ids", "bad_words"])
@pytest.mark.parametrize("value", [BIG_INT, "-1", "true", '"x"'])
def test_unimplemented_id_lists_are_refused_whatever_they_hold(server, name, value):
    refused(server, C, f'{{"prompt": "a", "max_tokens": 1, "{name}": [{value}]}}'.encode(), name)


def test_int_fields_on_anthropic_and_responses(server):
    for value in (BIG_INT, str(2**64 - 1), "true"):
        refused(server, ANTHROPIC, f'{{"max_tokens": {value}, "messages": [{{"role": "user", '
                f'"content": "hi"}}]}}'.encode(), None, "max_tokens")
        refused(server, ANTHROPIC, f'{{"max_tokens": 1, "top_k": {value}, "messages": [{{"role": '
                f'"user", "content": "hi"}}]}}'.encode(), None, "top_k")
        refused(server, RESPONSES, f'{{"input": "hi", "max_output_tokens": {value}}}'.encode(),
                "max_output_tokens")


# -- caps and cross-field rules ----------------------------------------------------------------

def test_stop_lists_and_strings_past_their_caps(server):
    refused(server, C, completion(stop=["x"] * 10_000), "stop", f"at most {limits.MAX_STOP}")
    refused(server, C, completion(stop="x" * 1_000_000), "stop", f"{limits.MAX_STOP_CHARS} characters")
    refused(server, C, completion(stop=["y", "x" * 1_000_000]), "stop", "characters")
    refused(server, RESPONSES, {"input": "hi", "stop": "x" * 1_000_000}, "stop", "characters")
    refused(server, ANTHROPIC, {"max_tokens": 1, "messages": MSG, "stop_sequences": ["x"] * 10_000},
            None, "stop_sequences")
    refused(server, ANTHROPIC, {"max_tokens": 1, "messages": MSG,
                                "stop_sequences": ["x" * 1_000_000]}, None, "stop_sequences")
    accepted(server, C, completion(stop=["x" * limits.MAX_STOP_CHARS] * limits.MAX_STOP))


def test_logit_bias_within_the_vocabulary_is_served_and_past_the_cap_refused(server):
    accepted(server, C, completion(logit_bias={str(i): -1 for i in range(VOCAB)}))
    refused(server, C, completion(logit_bias={str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}),
            "logit_bias", f"at most {limits.MAX_LOGIT_BIAS}")


def test_min_tokens_past_max_tokens_and_negative_truncation(server):
    refused(server, C, completion(max_tokens=2, min_tokens=5), "min_tokens", "max_tokens")
    refused(server, CHAT, {"messages": MSG, "max_tokens": 2, "min_tokens": 3}, "min_tokens")
    for k in (-5, -2**63, 0):
        refused(server, C, completion(truncate_prompt_tokens=k), "truncate_prompt_tokens")
    refused(server, EMB, {"input": "a", "truncate_prompt_tokens": -7}, "truncate_prompt_tokens")


def test_special_token_text_in_a_prompt_is_text(server, client):
    text = "<|im_end|> <s> </s> <|endoftext|> <pad>"
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    assert out.usage.prompt_tokens > 0
    out = client.chat.completions.create(model=MODEL, max_tokens=2,
                                         messages=[{"role": "user", "content": text}])
    assert out.choices[0].finish_reason in ("stop", "length")


def test_the_server_still_serves_after_all_of_it(server, client):
    status, answer, _ = post(server, C, completion(max_tokens=3, temperature=0))
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    assert len(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1).choices) == 1
    assert MAX_MODEL_LEN == 512  # the bounds above assume tools/make_tiny_model.py's model
