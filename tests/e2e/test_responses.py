"""The Responses API end to end: the real server on the default model, spoken to through the
openai SDK's client.responses over a real socket. A regex grammar (vLLM's structured_outputs
extra) scripts exact text where a test needs to know it; JSON schemas and forced tool calls
are enforced by their own grammars, so every output is checked against its schema."""

import json
import time
import urllib.request

import jsonschema
import openai
import pydantic
import pytest

from .server import ServerProcess, assert_books_balanced, regex_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PARIS = "The capital of France is Paris."
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


def scripted(text: str) -> dict:
    return {"structured_outputs": {"regex": regex_for(text)}}


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, **kw):
    return client.responses.create(**{"model": MODEL, "input": "What is the capital of France?",
                                      "temperature": 0, "max_output_tokens": 40, **kw})


def test_plain(client):
    r = ask(client, instructions="Answer in one sentence.", extra_body=scripted(PARIS),
            metadata={"run": "1"})
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == PARIS and r.model == MODEL
    message = r.output[0]
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.metadata == {"run": "1"}
    assert r.error is None and r.incomplete_details is None and r.max_output_tokens == 40
    free = ask(client, max_output_tokens=12)  # the model's own text, greedy
    assert free.output_text and free.status in ("completed", "incomplete")


def test_streamed(client):
    whole = ask(client, extra_body=scripted(PARIS))
    events = list(ask(client, extra_body=scripted(PARIS), stream=True))
    assert all(isinstance(e, pydantic.BaseModel) and not isinstance(e, dict) for e in events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    final = events[-1].response
    assert "".join(deltas) == final.output_text == events[-4].text == whole.output_text == PARIS
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert type(events[4]).__name__ == "ResponseTextDeltaEvent"
    # the SDK's stream helper accumulates the same events into its final response
    with client.responses.stream(model=MODEL, input="What is the capital of France?", temperature=0,
                                 max_output_tokens=40, extra_body=scripted(PARIS)) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper = stream.get_final_response()
    assert "".join(texts) == helper.output_text == PARIS and helper.status == "completed"


def test_previous_response_id_continues_the_conversation(client):
    first = ask(client, extra_body=scripted(PARIS))
    second = ask(client, input="And of Italy?", previous_response_id=first.id,
                 extra_body=scripted("Rome."))
    assert second.output_text == "Rome." and second.previous_response_id == first.id
    # the second prompt holds the first prompt and its answer
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    alone = ask(client, input="And of Italy?", extra_body=scripted("Rome."))
    assert second.usage.input_tokens > alone.usage.input_tokens
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == PARIS and fetched.status == "completed"
    third = ask(client, input="And of Spain?", previous_response_id=second.id,
                extra_body=scripted("Madrid."), store=False)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(third.id)  # store: false keeps nothing


def test_a_required_function_call_and_its_output(client):
    r = ask(client, input="What is the weather in Paris?", tools=[WEATHER, ADD], tool_choice="required",
            max_output_tokens=120)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    schemas = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    # the tool's result goes back as a function_call_output item on the stored conversation
    follow = ask(client, previous_response_id=r.id, extra_body=scripted("It is sunny."),
                 input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.output_text == "It is sunny." and follow.usage.input_tokens > r.usage.input_tokens
    # the same turn as input items without the store: the SDK sends the output items back
    replay = ask(client, extra_body=scripted("It is sunny."), input=[
        {"role": "user", "content": "What is the weather in Paris?"}, *r.output,
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert replay.output_text == "It is sunny."
    assert replay.usage.input_tokens == follow.usage.input_tokens  # the same prompt


def test_a_named_function_streams_its_call(client):
    kw = dict(input="Add 12 and 30.", tools=[ADD], tool_choice={"type": "function", "name": "add"},
              max_output_tokens=60)
    whole = ask(client, **kw)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "add"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    events = list(ask(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    final = events[-1].response.output[0]
    # a forced call is held to its end (a call max_tokens cut short is no call, as in vLLM):
    # its arguments come in one delta
    assert len(deltas) == 1 and "".join(deltas) == events[-3].arguments == final.arguments == call.arguments
    assert final.call_id == events[2].item.call_id


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False}
    r = ask(client, input="Describe Paris as JSON.", max_output_tokens=80,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"

    class City(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=99999999)

    parsed = client.responses.parse(model=MODEL, input="Describe Paris as JSON.", temperature=0,
                                    max_output_tokens=80, text_format=City)
    assert isinstance(parsed.output_parsed, City)
    obj = ask(client, input="Describe Paris as JSON.", max_output_tokens=80, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def test_tools_on_a_server_without_auto_tool_choice_get_text(client):
    """As vLLM's Responses: tools with tool_choice "auto" on a server started without
    --enable-auto-tool-choice are shown to the model, and the answer is read as text (the
    chat route refuses the same request)."""
    r = ask(client, tools=[ADD], extra_body=scripted(PARIS))
    assert r.status == "completed" and r.output_text == PARIS and r.tool_choice == "auto"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       tools=[{"type": "function", "function": {"name": "add"}}])


def test_a_forced_call_with_a_text_format_and_cached_tokens(client):
    """The Agents SDK sends its output_type's schema on tool turns too: a forced call answers
    with the call; usage names the prompt tokens the prefix cache served, as vLLM's
    Responses does without --enable-prompt-tokens-details."""
    fmt = {"format": {"type": "json_schema", "name": "w", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    r = ask(client, input="Weather in Paris?", tools=[WEATHER], tool_choice="required", text=fmt,
            max_output_tokens=200)
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "get_weather"
    long = "Tell me about Paris. " * 40
    first, again = ask(client, input=long, max_output_tokens=2), ask(client, input=long, max_output_tokens=2)
    assert first.usage.input_tokens == again.usage.input_tokens > 200
    assert again.usage.input_tokens_details.cached_tokens >= 192  # whole blocks of the first


def test_logprobs_when_included_equal_the_chat_paths(client):
    """include message.output_text.logprobs (top_logprobs alternatives each), as vLLM reads
    them: the output text's token logprobs, the chat route's for the same request, whole and
    streamed alike; top_logprobs without the include adds none (vLLM's rule)."""
    question = "What is the capital of France?"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
    expected = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]
    r = ask(client, input=question, max_output_tokens=8, top_logprobs=2,
            include=["message.output_text.logprobs"])
    got = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
           for t in r.output[0].content[0].logprobs]
    # the same tokens and alternatives; the values within what a prefix-cache hit's different
    # prefill chunks move them (the later requests reuse the first one's prompt blocks)
    def same(a, b):
        assert [(t, [x for x, _ in alt]) for t, _, alt in a] == [(t, [x for x, _ in alt]) for t, _, alt in b]
        assert [lp for _, lp, _ in a] == pytest.approx([lp for _, lp, _ in b], abs=1e-3)

    same(got, expected)
    assert len(got) == 8 and r.top_logprobs == 2
    events = list(ask(client, input=question, max_output_tokens=8, top_logprobs=2, stream=True,
                      include=["message.output_text.logprobs"]))
    final = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
             for t in events[-1].response.output[0].content[0].logprobs]
    same(final, expected)
    # the deltas carry their own tokens' (a token without text, the end of turn here, has no
    # delta: only the message holds it)
    deltas = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
              for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert deltas and deltas == final[:len(deltas)]
    assert ask(client, input=question, max_output_tokens=8, top_logprobs=2).output[0].content[0].logprobs == []


def test_max_output_tokens_is_incomplete(client):
    r = ask(client, input="Count from one to one hundred in words.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output_text
    events = list(ask(client, input="Count from one to one hundred in words.", max_output_tokens=5, stream=True))
    # vLLM ends every stream with response.completed, the response's status in it
    assert events[-1].type == "response.completed" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text
    # so the SDK's stream helper finishes on it (it waits for response.completed)
    with client.responses.stream(model=MODEL, input="Count from one to one hundred in words.",
                                 temperature=0, max_output_tokens=5) as stream:
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == r.output_text


def test_unknown_fields_are_ignored_and_reasoning_effort_is_taken(client):
    """vLLM's request model allows extra fields; reasoning.effort reaches the chat template as
    reasoning_effort (this model's template ignores it), so the answer is the plain one."""
    plain = ask(client, max_output_tokens=8)
    r = ask(client, max_output_tokens=8, reasoning={"effort": "low"},
            extra_body={"frobnicate": True})
    assert r.status == plain.status and r.output_text == plain.output_text


def test_what_the_agents_sdk_sends(client):
    """openai-agents sends include and tools even when empty, and text with only a verbosity;
    clients turn obfuscation off with stream_options. The echo fills in what OpenAI's does."""
    kw = dict(include=[], tools=[], text={"verbosity": "low"}, metadata={"run": "2"},
              safety_identifier="s", prompt_cache_key="k",
              extra_body={**scripted(PARIS), "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
                          "background_options": {"completion_window": "soonest"},
                          "image": {"context_compression": "auto"}})
    r = ask(client, **kw)
    assert r.output_text == PARIS and r.text.format.type == "text" and r.text.verbosity == "low"
    assert (r.safety_identifier, r.prompt_cache_key) == ("s", "k") and r.completed_at >= r.created_at
    assert r.service_tier == "auto" and ask(client, service_tier="flex", extra_body=scripted(PARIS)).service_tier == "flex"
    events = list(ask(client, stream=True, stream_options={"include_obfuscation": False}, **kw))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == PARIS
    assert events[0].response.completed_at is None and events[-1].response.text.format.type == "text"


def test_max_output_tokens_is_capped_at_the_room_the_prompt_leaves(client):
    """vLLM's Responses caps max_output_tokens at the context the prompt leaves (chat refuses)."""
    r = ask(client, max_output_tokens=10**6, extra_body=scripted(PARIS))
    assert r.status == "completed" and r.output_text == PARIS
    with pytest.raises(openai.BadRequestError):  # the chat route refuses the same ask
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=10**6)


def test_reasoning_items_and_an_unfinished_answer(client):
    """Reasoning items replayed from another server's output are read (into the assistant
    turn's reasoning_content); a last assistant message left incomplete is continued, as the
    chat path continues a final message with continue_final_message."""
    history = [{"role": "user", "content": "Count to five."},
               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Easy."}]},
               {"type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "One, two, three, four, five."}]},
               {"role": "user", "content": "Again."}]
    assert ask(client, input=history, max_output_tokens=8, reasoning={"effort": "low"}).reasoning.effort == "low"
    partial = [{"role": "user", "content": "Count to five."},
               {"type": "message", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "One, two,"}]}]
    r = ask(client, input=partial, max_output_tokens=6)
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=6, messages=[
            {"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.output_text == chat.choices[0].message.content


def test_delete_then_get_is_404(client):
    r = ask(client, max_output_tokens=4)
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert set(info.value.body) == {"message", "type", "param", "code"} and r.id in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_truncation_auto_drops_the_oldest_exchanges(client):
    items = [{"role": "user", "content": "word " * 9000}, {"role": "assistant", "content": "Noted."},
             {"role": "user", "content": "What is the capital of France?"}]
    with pytest.raises(openai.BadRequestError) as info:  # truncation "disabled", the default
        ask(client, input=items)
    assert info.value.body["param"] == "input"
    r = ask(client, input=items, truncation="auto", extra_body=scripted(PARIS))
    assert r.status == "completed" and r.output_text == PARIS and r.truncation == "auto"
    alone = ask(client, input=items[2:], extra_body=scripted(PARIS))
    assert r.usage.input_tokens == alone.usage.input_tokens  # what was left: the last question
    # the stored conversation is whole; a later turn is cut again, by the same rule
    later = ask(client, input="And of Italy?", previous_response_id=r.id, truncation="auto")
    assert later.status in ("completed", "incomplete") and later.usage.input_tokens > alone.usage.input_tokens
    with pytest.raises(openai.BadRequestError):  # the last exchange alone is not cut
        ask(client, input=items[:1], truncation="auto")


def test_hosted_tools_are_left_out_and_named_in_the_log(server, client):
    """Codex's request: function tools, a namespace of them and the hosted web_search, store
    false, streamed. web_search is left out of the prompt (as vLLM leaves it out) and the
    server's log names the response; the answer is the one without it. (Before: a 400.)"""
    web_search = {"type": "web_search", "external_web_access": False}
    agents = {"type": "namespace", "name": "agents", "description": "Sub-agents", "tools": [ADD]}
    kw = dict(extra_body=scripted(PARIS), store=False, parallel_tool_calls=True,
              include=["reasoning.encrypted_content"])
    whole = ask(client, tools=[WEATHER, agents, web_search], **kw)
    assert whole.status == "completed" and whole.output_text == PARIS
    assert [t.type for t in whole.tools] == ["function", "namespace", "web_search"]  # the echo
    without = ask(client, tools=[WEATHER, agents], **kw)
    assert without.usage.input_tokens == whole.usage.input_tokens
    with client.responses.stream(model=MODEL, input="What is the capital of France?",
                                 temperature=0, max_output_tokens=40,
                                 tools=[WEATHER, agents, web_search], **kw) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == PARIS
    for response in (whole, streamed):
        assert server.logged(f"request {response.id}: hosted tools left out of the prompt (this "
                             "server does not run them): web_search")
    assert f"request {without.id}:" not in server.output()


@pytest.mark.parametrize("kw,status,param", [
    (dict(tools=[{"type": "custom", "name": "apply_patch"}]), 400, "tools"),
    (dict(tools=[ADD, {"type": "web_search"}], tool_choice={"type": "web_search"}), 400, "tool_choice"),
    (dict(tools=[{"type": "web_search"}], tool_choice="required"), 400, "tool_choice"),
    (dict(previous_response_id="resp_does_not_exist"), 404, "previous_response_id"),
    (dict(reasoning={"effort": "extreme"}), 400, "reasoning"),  # the chat path's check
    (dict(reasoning={"effort": "low", "summary": "brief"}), 400, "reasoning"),
    (dict(extra_body={"truncation": "middle"}), 400, "truncation"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     400, "input"),
    (dict(model="no-such-model"), 404, "model"),
    (dict(metadata={"run": 1}), 400, "metadata"),  # OpenAI's metadata values are strings
    (dict(include=["message.output_text.bogus"]), 400, "include"),
    (dict(extra_body={"moderation": {"model": "omni-moderation-latest"}}), 400, "moderation"),
    (dict(extra_body={"prompt_cache_options": {"prewarm": True}}), 400, "prompt_cache_options"),
    (dict(service_tier="cheapest"), 400, "service_tier"),
    (dict(tools=[{**ADD, "defer_loading": True}], tool_choice="required"), 400, "tools"),
    (dict(input=[{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                 {"role": "user", "content": "Hi"}]), 400, "input"),
    (dict(input="word " * 9000), 400, "input"),  # the prompt alone is longer than the model
])
def test_bad_inputs_get_openais_error_shape(client, kw, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        ask(client, **kw)
    assert info.value.status_code == status
    body = info.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param
    assert body["code"] == status and body["message"]


def test_a_client_leaving_a_stream_ends_its_request(client):
    def running() -> float:
        url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError("vllm:num_requests_running")

    stream = ask(client, input="Count to a thousand.", max_output_tokens=2000, stream=True,
                 extra_body={"ignore_eos": True})
    for _, event in zip(range(6), stream):
        pass
    assert event.type == "response.output_text.delta" and running() == 1
    stream.close()
    deadline = time.monotonic() + 10
    while running() != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running() == 0


def server_url(client) -> str:
    return str(client.base_url).rstrip("/").removesuffix("/v1")


def poll(client, response_id: str, until=("completed", "incomplete", "failed", "cancelled"),
         timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.responses.retrieve(response_id)
        if r.status in until or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_background_answers_at_once_and_ends_as_the_same_request_would(client):
    kw = dict(input="Name three colours.", max_output_tokens=12)  # the model's own text, greedy
    whole = ask(client, **kw)
    queued = ask(client, background=True, **kw)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = poll(client, queued.id)
    assert done.status == whole.status and done.background is True and done.id == queued.id
    assert done.output_text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    assert done.usage.input_tokens == whole.usage.input_tokens
    # it continues a conversation as any stored response does
    follow = ask(client, input="And a fourth?", previous_response_id=done.id, max_output_tokens=4)
    assert follow.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens
    with pytest.raises(openai.BadRequestError) as info:  # ended: nothing to cancel
        client.responses.cancel(done.id)
    assert info.value.body["param"] == "response_id"


def test_cancelling_a_background_response_in_flight_frees_its_blocks(client):
    queued = ask(client, input="Count to a thousand.", max_output_tokens=2000, background=True,
                 extra_body={"ignore_eos": True})
    running = poll(client, queued.id, until=("in_progress",))
    assert running.status == "in_progress"
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled" and cancelled.id == queued.id
    assert client.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    time.sleep(0.3)
    assert client.responses.retrieve(queued.id).status == "cancelled"  # and stays so
    books = assert_books_balanced(server_url(client))
    assert books["kv_blocks_referenced"] == 0 and books["requests_aborted"] >= 1


def test_a_background_stream_resumes_after_a_sequence_number(client):
    stream = ask(client, background=True, stream=True, extra_body=scripted(PARIS))
    head = [event for _, event in zip(range(5), stream)]
    stream.close()  # the client leaves; the response goes on
    assert head[0].type == "response.created" and head[0].response.background is True
    rest = list(client.responses.retrieve(head[0].response.id, stream=True,
                                          starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == PARIS
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == PARIS
    assert client.responses.retrieve(head[0].response.id).output_text == PARIS


def test_background_refusals(client):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, background=True, store=False)
    assert info.value.body["param"] == "background" and "store" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.cancel("resp_does_not_exist")
    assert set(info.value.body) == {"message", "type", "param", "code"}
    assert "resp_does_not_exist" in info.value.body["message"]
    finished = ask(client, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(finished.id)
    assert info.value.body["message"] == "Cannot cancel a synchronous response."
    assert client.responses.retrieve(finished.id).status == finished.status  # unchanged
    with pytest.raises(openai.BadRequestError) as info:  # only a background stream is replayed
        client.responses.retrieve(finished.id, stream=True)
    assert info.value.body["param"] == "stream"


CALLS = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
         '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>')


@pytest.fixture(scope="module")
def hermes(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.stop() == 0


def test_auto_tool_choice_gives_text_and_calls_whole_and_streamed(hermes):
    kw = dict(input="Add 12 and 30, then the weather in Paris.", tools=[ADD, WEATHER],
              max_output_tokens=200, extra_body=scripted(CALLS))
    whole = ask(hermes, **kw)
    assert [o.type for o in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me add."
    assert [(o.name, json.loads(o.arguments)) for o in whole.output[1:]] == [
        ("add", {"a": 12, "b": 30}), ("get_weather", {"city": "Paris", "unit": "celsius"})]
    events = list(ask(hermes, stream=True, **kw))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta").strip() == "Let me add."
    for index, item in enumerate(final.output[1:], start=1):
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta" and e.output_index == index)
        assert args == item.arguments == whole.output[index].arguments
    assert len({o.call_id for o in final.output[1:]}) == 2


def test_reasoning_comes_back_as_a_reasoning_item(hermes):
    kw = dict(model=MODEL, input="What is 12 plus 30?", temperature=0, max_output_tokens=60,
              extra_body=scripted("<think>Twelve and thirty.</think>It is 42."))
    r = hermes.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "It is 42."
    assert r.output[0].content[0].text == "Twelve and thirty."
    with hermes.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Twelve and thirty." == final.output[0].content[0].text
    assert final.output_text == "It is 42."
    # the next turn, from the stored one, is read with the reasoning as the turn's own
    again = hermes.responses.create(**{**kw, "input": "And 1 + 1?", "previous_response_id": r.id})
    assert again.status == "completed" and again.output_text == "It is 42."
    # a summary asked for is the whole reasoning, whole and streamed (the SDK's stream helper
    # accumulates the summary events into the item too)
    summarized = {**kw, "reasoning": {"effort": "low", "summary": "auto"}}
    r = hermes.responses.create(**summarized)
    assert [p.text for p in r.output[0].summary] == ["Twelve and thirty."] and r.reasoning.summary == "auto"
    with hermes.responses.stream(**summarized) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_summary_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Twelve and thirty." == final.output[0].summary[0].text
    assert final.output[0].content[0].text == "Twelve and thirty."


def test_input_tokens_count_what_create_renders(client):
    """POST /v1/responses/input_tokens (the SDK's responses.input_tokens.count): the prompt a
    create would render, previous_response_id's conversation included."""
    kw = dict(model=MODEL, input="What is the capital of France?", instructions="Be brief.")
    counted = client.responses.input_tokens.count(**kw)
    made = ask(client, **kw, max_output_tokens=2)
    assert counted.object == "response.input_tokens" and counted.input_tokens == made.usage.input_tokens
    later = client.responses.input_tokens.count(model=MODEL, input="And Italy?", previous_response_id=made.id)
    assert later.input_tokens > counted.input_tokens  # the stored turn, answer and all, leads it
    with pytest.raises(openai.BadRequestError):
        client.responses.input_tokens.count(model=MODEL, input=[{"type": "bogus"}])
