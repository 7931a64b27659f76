"""Where vLLM's OpenAI server has a defined behaviour that clients rely on, pyserve's matches it:
defaults, logprob shapes, echo scoring, tool and structured-output requests it cannot honour,
lax types, and requests that must fail alone without taking the engine down. Spoken to through
the official openai SDK over a real socket."""

import json
import threading

import openai
import pytest

from .server import ServerProcess
from .test_server import http_json

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "smol", "--trust-request-chat-template",
                        "--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_default_to_16_tokens_and_chat_reads_max_completion_tokens(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time",
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to fifty."}],
        extra_body={"max_completion_tokens": None, "max_tokens": 3, "ignore_eos": True})
    assert chat.usage.completion_tokens == 3


def test_any_served_name_or_none_is_the_model(client):
    for name in ("smol", ""):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert out.model == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL, "smol"]


def test_chat_top_logprobs_are_the_k_most_likely(client):
    messages = [{"role": "user", "content": "Write a word."}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                            temperature=0, logprobs=True, top_logprobs=3)
    first = greedy.choices[0].logprobs.content[0]
    assert first.top_logprobs[0].token == first.token  # the greedy token is the most likely
    # sampled at a high temperature, tokens outside the top 3 are drawn; the list stays the top 3
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48,
                                         temperature=2.0, seed=3, logprobs=True, top_logprobs=3)
    outside = 0
    for position in out.choices[0].logprobs.content:
        top = position.top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob
        if position.logprob < top[2].logprob:
            outside += 1
            # (by logprob, not by text: byte-fallback tokens all read as '\ufffd')
            assert position.logprob not in [t.logprob for t in top]
    assert outside > 0  # the case that tells "top k by rank" from "sampled token first"
    sampled = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                             temperature=2.0, seed=3, logprobs=True, top_logprobs=3)
    assert sampled.choices[0].logprobs.content[0].top_logprobs[0].token == first.token


def test_echo_scores_the_prompt(client):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                    echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    n = out.usage.prompt_tokens
    assert len(lp.tokens) == n + 2 and "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 2)]
    # max_tokens 0 with echo: the prompt alone, scored (lm-evaluation-harness' loglikelihood)
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert only.choices[0].text == prompt
    assert only.usage.completion_tokens == 1  # generated and counted, not shown (as vLLM)
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)
    # streamed, two choices, a stop string holding text back: each choice gets the prompt's
    # scores and the same offsets as the whole response
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2,
                                      echo=True, logprobs=1, stop=["###"])
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                              n=2, echo=True, logprobs=1, stop=["###"], stream=True))
    for choice in whole.choices:
        chunks = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert chunks[0].text.startswith(prompt) and chunks[0].logprobs.token_logprobs[0] is None
        assert "".join(c.text for c in chunks) == choice.text
        joined = lambda key: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, key)]
        assert joined("tokens") == choice.logprobs.tokens
        assert joined("text_offset") == choice.logprobs.text_offset
        assert joined("token_logprobs") == pytest.approx(choice.logprobs.token_logprobs, abs=1e-5)


def test_stream_usage_when_asked_counted_per_choice(client):
    stream = dict(model=MODEL, prompt="Hello", max_tokens=3, n=2, temperature=1.0, seed=1,
                  stream=True, extra_body={"ignore_eos": True})
    assert all(c.usage is None for c in client.completions.create(**stream, stream_options={}))
    chunks = list(client.completions.create(**stream, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    chunks = list(client.completions.create(
        **stream, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    per_choice = {}
    for c in chunks:
        if c.choices:
            per_choice.setdefault(c.choices[0].index, []).append(c.usage.completion_tokens)
    assert per_choice == {0: [1, 2, 3], 1: [1, 2, 3]}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),  # beam search reads no top_p
    ({"logits_processors": ["my.module:Processor"]}, "logits_processors"),
    ({"prompt": "x"}, "prompt"),
    ({"seed": "abc"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"priority": 3}, "priority"),
    ({"best_of": 2}, "best_of"),
    ({"n": 1.5}, "n"),
    ({"stream": True, "stream_options": "yes"}, "stream_options"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | extra
    status, raw, _ = http_json(server, "POST", "/v1/chat/completions", body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param


def test_lax_types_tools_shown_with_none_and_tool_turns(server, client):
    status, raw, _ = http_json(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "max_tokens": "2", "n": 1.0, "stream": "false",
        "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    out = client.chat.completions.create(
        model=MODEL, max_tokens=2, tools=tools, tool_choice="none", messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert out.choices[0].finish_reason in ("length", "stop")


def test_tool_calls_reach_the_template_with_parsed_arguments(server):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }}"
                "({{ c.function.arguments.city }})]{% endfor %}\n{% endfor %}")
    messages = [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]}]
    status, raw, _ = http_json(server, "POST", "/tokenize", {
        "messages": messages, "chat_template": template, "add_generation_prompt": False,
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {}}}]})
    assert status == 200, raw  # /tokenize renders tools whatever tool_choice says
    status, text, _ = http_json(server, "POST", "/detokenize", {"tokens": json.loads(raw)["tokens"]})
    assert json.loads(text)["prompt"] == "assistant:[weather(Paris)]"  # Jinja drops the last newline


def test_continue_final_message_extends_the_assistant_turn(server):
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there"}]
    status, raw, _ = http_json(server, "POST", "/tokenize", {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert status == 200
    status, text, _ = http_json(server, "POST", "/detokenize", {"tokens": json.loads(raw)["tokens"]})
    assert json.loads(text)["prompt"].endswith("Hi there")


def test_a_huge_top_k_does_not_fail_its_batch(client):
    """top_k beyond the vocabulary means all tokens (vLLM clamps it); batched with a request
    with a small top_k it once broke the sampler's tensor and, with it, the step loop."""
    results = {}

    def run(name, top_k):
        results[name] = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=32, extra_body={"top_k": top_k, "ignore_eos": True})

    threads = [threading.Thread(target=run, args=(str(k), k)) for k in (2, 2**62)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.usage.completion_tokens == 32 for r in results.values())


def test_truncate_prompt_tokens_keeps_the_last_ones(client):
    out = client.completions.create(model=MODEL, prompt="one two three four five six seven eight",
                                    max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert out.usage.prompt_tokens == 3
    ids = client.completions.create(model=MODEL, prompt=[[1, 504, 3384, 314, 28]], max_tokens=1,
                                    echo=True, extra_body={"truncate_prompt_tokens": 2})
    assert ids.usage.prompt_tokens == 2
