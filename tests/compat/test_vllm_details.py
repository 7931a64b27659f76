"""The details vLLM's own server tests check, written from vLLM's semantics (its protocol
models and serving_*.py, vLLM main as of 2026, which we take for 0.32): the fields every
response object always carries, custom roles, the seed's range, the error messages clients
match on, logprobs over the whole vocabulary, token ids in responses, prompt truncation,
cached-token usage and chat echo. Spoken to over a real socket, as raw JSON (which fields are
present, which null) and through the openai SDK."""

import json
import uuid

import openai
import pytest

from tests.e2e.server import ServerProcess

from .wire import post, stream

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
BLOCK = 16  # the default --block-size: the prefix cache serves whole blocks


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-prompt-tokens-details",
                        "--max-logprobs", "-1", "--trust-request-chat-template")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 3, "temperature": 0, **extra}


def completion_body(**extra):
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, **extra}


# -- fields every object carries ---------------------------------------------------------------
def test_a_completion_carries_every_field_vllm_sends(server, client):
    status, out = post(server, "/v1/completions", completion_body())
    assert status == 200
    assert list(out) == ["id", "object", "created", "model", "choices", "service_tier",
                         "system_fingerprint", "usage", "kv_transfer_params"]
    assert out["service_tier"] is out["system_fingerprint"] is out["kv_transfer_params"] is None
    choice = out["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason",
                           "token_ids", "prompt_logprobs", "prompt_token_ids"}
    assert choice["prompt_logprobs"] is choice["prompt_token_ids"] is choice["token_ids"] is None
    assert set(out["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens",
                                 "prompt_tokens_details"}
    # what clients written against vLLM read
    sdk = client.completions.create(**completion_body())
    assert sdk.choices[0].prompt_logprobs is None and sdk.choices[0].stop_reason is None


def test_a_chat_response_carries_every_field_vllm_sends(server, client):
    status, out = post(server, "/v1/chat/completions", chat_body())
    assert status == 200
    assert list(out) == ["id", "object", "created", "model", "choices", "service_tier",
                         "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
                         "kv_transfer_params"]
    assert out["prompt_logprobs"] is out["prompt_token_ids"] is None
    choice = out["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason",
                           "token_ids"}
    message = choice["message"]
    assert {"role", "content", "refusal", "annotations", "audio", "function_call", "tool_calls",
            "reasoning"} <= set(message)
    assert message["refusal"] is message["reasoning"] is message["function_call"] is None
    assert message["tool_calls"] == []
    sdk = client.chat.completions.create(**chat_body())
    assert sdk.prompt_logprobs is None and sdk.choices[0].stop_reason is None


def test_stream_chunks_carry_the_fields_vllm_sets(server):
    chunks = stream(server, "/v1/completions", completion_body(
        stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}
        assert set(chunk["choices"][0]) == {"index", "text", "logprobs", "finish_reason",
                                            "stop_reason", "prompt_token_ids", "token_ids"}
    assert chunks[-1]["choices"] == [] and "prompt_tokens_details" in chunks[-1]["usage"]

    chunks = stream(server, "/v1/chat/completions", chat_body(
        stream_options={"include_usage": True}))
    role, *content, usage = chunks
    assert role["prompt_token_ids"] is None  # set on the first chunk only, null unless asked
    assert role["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}
    for chunk in content:
        assert "prompt_token_ids" not in chunk
        choice = chunk["choices"][0]
        assert {"index", "delta", "logprobs", "finish_reason", "token_ids"} <= set(choice)
        # vLLM sets stop_reason on a choice's last chunk only
        assert ("stop_reason" in choice) == (choice["finish_reason"] is not None)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


# -- custom roles, the seed, messages clients match on ----------------------------------------
def test_a_custom_role_reaches_the_chat_template(server, client):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    status, out = post(server, "/v1/chat/completions", chat_body(
        messages=[{"role": "ipython", "content": "42"}, {"role": "user", "content": "And?"}],
        chat_template=template, return_token_ids=True))
    assert status == 200, out
    _, text = post(server, "/detokenize", {"tokens": out["prompt_token_ids"]})
    assert text["prompt"] == "[ipython] 42\n[user] And?\n"
    # the model's own template takes it too
    out = client.chat.completions.create(**chat_body(messages=[
        {"role": "observation", "content": "It is raining."},
        {"role": "user", "content": "Umbrella?"}]))
    assert out.choices[0].message.role == "assistant"
    for bad in ({"content": "no role"}, {"role": "", "content": "x"}, {"role": 7, "content": "x"}):
        status, out = post(server, "/v1/chat/completions", chat_body(messages=[bad]))
        assert status == 400 and out["error"]["param"] == "messages", out


@pytest.mark.parametrize("path, body", [("/v1/completions", completion_body()),
                                        ("/v1/chat/completions", chat_body())])
def test_seeds_beyond_64_bits_are_refused(server, path, body):
    base = json.dumps(body)[:-1]
    # JSON text, not Python's: -2**63 - 1 must not round to -2**63 on its way in
    for seed in ("-9223372036854775809", "9223372036854775808", "18446744073709551616", "1e19"):
        status, out = post(server, path, None, raw=f'{base}, "seed": {seed}}}'.encode())
        assert status == 400 and out["error"]["param"] == "seed", (seed, out)
    for seed in ("-9223372036854775808", "9223372036854775807", "0"):
        status, out = post(server, path, None, raw=f'{base}, "seed": {seed}}}'.encode())
        assert status == 200, (seed, out)


def test_an_empty_prompt_says_what_vllm_says(client):
    for extra in ({"prompt": ""}, {"prompt": None, "extra_body": {"prompt_embeds": []}},
                  {"prompt": []}):
        with pytest.raises(openai.BadRequestError,
                           match="Either prompt or prompt_embeds must be provided and non-empty."):
            client.completions.create(model=MODEL, max_tokens=2, **extra)


def test_out_of_vocabulary_token_ids_say_so(client):
    for prompt in ([999999], [5, VOCAB], [[3, -1]]):
        with pytest.raises(openai.BadRequestError, match="out of vocabulary") as exc:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert exc.value.body["param"] == "prompt"


def test_an_invalid_logit_bias_names_the_token(client):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       logit_bias={str(VOCAB + 1): 1.0})
    assert str(VOCAB + 1) in exc.value.body["message"] and str(VOCAB) in exc.value.body["message"]
    assert exc.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert "bad1" in exc.value.body["message"] and "bad2" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       logit_bias={"17": "not_a_number"})
    assert "17" in exc.value.body["message"] and exc.value.body["param"] == "logit_bias"
    # biases beyond OpenAI's [-100, 100] are clamped, as vLLM does, not refused
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                         temperature=0, logit_bias={"28": 500},
                                         extra_body={"return_token_ids": True})
    assert out.choices[0].token_ids == [28, 28]


# -- logprobs over the whole vocabulary --------------------------------------------------------
def test_minus_one_logprobs_are_the_whole_vocabulary(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=1, logprobs=True, top_logprobs=-1)
    top = out.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == VOCAB and top[0].logprob >= top[-1].logprob
    # (a short template: the memory guard holds a prompt to 2**20 entries, 21 positions here)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, extra_body={
                                              "prompt_logprobs": -1,
                                              "chat_template": "{{ messages[0].content }}:"})
    assert chat.prompt_logprobs[0] is None
    assert all(len(p) >= VOCAB for p in chat.prompt_logprobs[1:])
    # completions key alternatives by their text, which byte tokens share: by id, all of them
    text = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, logprobs=-1,
                                     extra_body={"return_tokens_as_token_ids": True})
    assert all(len(p) == VOCAB for p in text.choices[0].logprobs.top_logprobs)


def test_whole_vocabulary_logprobs_are_bounded_by_the_response_they_make(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=100, logprobs=True, top_logprobs=-1)
    assert exc.value.body["param"] == "logprobs" and "max_tokens" in exc.value.body["message"]
    for bad in (-2, -10):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=1, logprobs=True, top_logprobs=bad)
        assert exc.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:  # -1 needs logprobs too
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, top_logprobs=-1)
    assert exc.value.body["param"] == "top_logprobs"


# -- token ids ---------------------------------------------------------------------------------
def test_return_token_ids_on_completions(server, client):
    prompt = "The capital of France is"
    _, tokens = post(server, "/tokenize", {"prompt": prompt})
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.prompt_token_ids == tokens["tokens"]
    _, text = post(server, "/detokenize", {"tokens": choice.token_ids})
    assert len(choice.token_ids) == 5 and text["prompt"] == choice.text
    chunks = stream(server, "/v1/completions", completion_body(prompt=prompt, max_tokens=5,
                                                               return_token_ids=True))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == tokens["tokens"]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:])
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice.token_ids
    # vLLM: with echo the ids stand for the prompt, whose text is not echoed; the logprobs
    # still score it
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                     echo=True, logprobs=0, extra_body={"return_token_ids": True})
    assert echo.choices[0].text == choice.text[:len(echo.choices[0].text)]
    assert len(echo.choices[0].logprobs.tokens) == len(tokens["tokens"]) + 2


def test_return_token_ids_on_chat(server, client):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                           temperature=0, extra_body={"return_token_ids": True})
    _, prompt = post(server, "/detokenize", {"tokens": whole.prompt_token_ids})
    assert prompt["prompt"].endswith("Name a color.<|im_end|>\n<|im_start|>assistant\n")
    _, text = post(server, "/detokenize", {"tokens": whole.choices[0].token_ids})
    assert text["prompt"] == whole.choices[0].message.content
    chunks = stream(server, "/v1/chat/completions", chat_body(messages=messages, max_tokens=5,
                                                              return_token_ids=True))
    assert chunks[0]["prompt_token_ids"] == whole.prompt_token_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed = sum((c["choices"][0]["token_ids"] for c in chunks[1:]), [])
    assert streamed == whole.choices[0].token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                    logprobs=1, echo=True,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "return_token_ids": True})
    lp, choice = out.choices[0].logprobs, out.choices[0]
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert ids == choice.prompt_token_ids + choice.token_ids
    assert all(k.startswith("token_id:") for p in lp.top_logprobs[1:] for k in p)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True,
                                                      "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)
    chunks = stream(server, "/v1/completions", completion_body(
        max_tokens=4, logprobs=0, return_tokens_as_token_ids=True, return_token_ids=True))
    for chunk in chunks:
        choice = chunk["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


# -- truncation --------------------------------------------------------------------------------
def test_truncation_side_picks_which_end_is_kept(server, client):
    prompt = [1, 504, 3384, 314, 28]
    kept = {}
    for side in ("left", "right", None):
        extra = {"truncate_prompt_tokens": 2, "return_token_ids": True}
        if side is not None:
            extra["truncation_side"] = side
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        kept[side] = out.choices[0].prompt_token_ids
        assert out.usage.prompt_tokens == 2
    assert kept == {"left": [314, 28], "right": [1, 504], None: [314, 28]}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right",
                    "return_token_ids": True})
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi there"}], max_tokens=1,
        extra_body={"return_token_ids": True})
    assert chat.prompt_token_ids == full.prompt_token_ids[:3]
    status, out = post(server, "/v1/completions", completion_body(truncate_prompt_tokens=2,
                                                                  truncation_side="middle"))
    assert status == 400 and out["error"]["param"] == "truncation_side"
    # vLLM: the kept prompt must leave room for max_tokens in the model length (8192)
    status, out = post(server, "/v1/completions", completion_body(truncate_prompt_tokens=8190,
                                                                  max_tokens=3))
    assert status == 400 and out["error"]["param"] == "truncate_prompt_tokens", out
    assert "8189" in out["error"]["message"]


# -- cached tokens -----------------------------------------------------------------------------
def test_cached_tokens_are_the_prefix_cache_hits(server):
    # a prompt no earlier request shares: the first sight of it is all computed
    system = f"Session {uuid.uuid4().hex}. " + "You answer in one word. " * 12
    body = chat_body(messages=[{"role": "system", "content": system},
                               {"role": "user", "content": "Yes?"}], max_tokens=1)
    _, first = post(server, "/v1/chat/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # 0 is reported
    _, again = post(server, "/v1/chat/completions", body)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 3 * BLOCK and cached % BLOCK == 0 and cached < again["usage"]["prompt_tokens"]
    chunks = stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}


# -- chat echo ---------------------------------------------------------------------------------
SAYING = "Here is a common saying about apples. An apple a day, keeps"
CONTINUED = [{"role": "user", "content": "Tell me a common saying."},
             {"role": "assistant", "content": SAYING}]


def test_chat_echo_leads_with_the_continued_message(server, client):
    def ask(echo, **extra):
        return client.chat.completions.create(
            model=MODEL, messages=CONTINUED, max_tokens=6, temperature=0,
            extra_body={"echo": echo, "continue_final_message": True,
                        "add_generation_prompt": False, **extra})

    plain, echoed = ask(False), ask(True)
    assert not plain.choices[0].message.content.startswith(SAYING)
    assert echoed.choices[0].message.content == SAYING + plain.choices[0].message.content
    # the echo is not generated
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    # streamed: the role, the echoed message, then the continuation
    chunks = stream(server, "/v1/chat/completions", {
        "model": MODEL, "messages": CONTINUED, "max_tokens": 6, "temperature": 0, "echo": True,
        "continue_final_message": True, "add_generation_prompt": False})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": SAYING}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == echoed.choices[0].message.content


def test_chat_echo_needs_the_last_message_to_be_the_replys_role(client):
    # after a generation prompt the reply is the assistant's; the user's turn is not echoed
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
    echo = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                          temperature=0, extra_body={"echo": True})
    assert echo.choices[0].message.content == plain.choices[0].message.content
