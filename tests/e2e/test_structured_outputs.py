"""Structured outputs and forced tool calls end to end: the real server on the default model,
spoken to through the openai SDK. The grammar makes even a 135M model's output valid, so every
sample is checked against its schema, regex, choice or grammar."""

import json
import re
import threading
import time
import urllib.request

import jsonschema
import openai
import pydantic
import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24, "pattern": "^[A-Z][a-z]+$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                   "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "scores"],
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"]}}},
]


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(content):
    return [{"role": "user", "content": content}]


def test_json_schema_outputs_validate(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ask("Make up a person."), n=3, temperature=1.0, seed=5, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert len(out.choices) == 3
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_and_the_older_field_names(client):
    out = client.chat.completions.create(model=MODEL, messages=ask("A JSON object, please."),
                                         max_tokens=60, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.chat.completions.create(model=MODEL, messages=ask("Pick."), max_tokens=10,
                                         extra_body={"guided_choice": ["red", "green", "blue"]})
    assert out.choices[0].message.content in ("red", "green", "blue")


def test_parse_with_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int
        coastal: bool

    out = client.chat.completions.parse(model=MODEL, messages=ask("Describe Paris."),
                                        response_format=City, max_tokens=80)
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and isinstance(city.population, int)


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[A-Z]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
    ({"choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'},
     lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
])
def test_completions_regex_choice_and_grammar(client, spec, check):
    for seed in (1, 2):
        out = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0,
                                        seed=seed, extra_body={"structured_outputs": spec})
        text = out.choices[0].text
        assert check(text), text
        assert out.choices[0].finish_reason == "stop"


def test_a_streamed_constrained_output_equals_the_whole_one(client):
    args = dict(model=MODEL, prompt="A code:", max_tokens=20, temperature=0,
                extra_body={"structured_outputs": {"regex": r"[a-f0-9]{8}"}})
    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True)
                       if c.choices)
    assert whole == streamed and re.fullmatch(r"[a-f0-9]{8}", whole)


def _validate_call(call):
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_required_tool_choice_gives_valid_calls(client):
    for seed in (1, 2, 3):
        out = client.chat.completions.create(model=MODEL, messages=ask("What is 2 + 3?"), tools=TOOLS,
                                             tool_choice="required", temperature=1.0, seed=seed,
                                             max_tokens=120)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            _validate_call(call)


def test_required_without_parallel_calls_ends_after_one_call(client):
    # greedy, this model repeats the list's item until max_tokens (then no call at all): one
    # item is the most the grammar lets it write when one call is all the answer can keep
    args = dict(model=MODEL, messages=ask("Add 12 and 30."), tools=TOOLS[1:], tool_choice="required",
                temperature=0, max_tokens=60)
    assert client.chat.completions.create(**args).choices[0].finish_reason == "length"
    choice = client.chat.completions.create(**args, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _validate_call(choice.message.tool_calls[0])


def test_named_tool_choice_and_its_stream(client):
    args = dict(model=MODEL, messages=ask("Weather in Rome?"), tools=TOOLS, temperature=0,
                max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**args).choices[0]
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and whole.finish_reason == "stop"
    _validate_call(call)
    name, arguments, ids = None, "", set()
    for chunk in client.chat.completions.create(**args, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert delta.index == 0
            if delta.id:
                ids.add(delta.id)
            if delta.function.name:
                name = delta.function.name
            arguments += delta.function.arguments or ""
    assert name == "get_weather" and arguments == call.function.arguments and len(ids) == 1


def test_required_stream_reassembles_to_the_whole_response(client):
    args = dict(model=MODEL, messages=ask("Add 4 and 5."), tools=TOOLS, tool_choice="required",
                temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**args).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
            entry["name"] = d.function.name or entry["name"]
            entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole]


def test_a_pathological_regex_stays_within_budget_and_the_server_answers(server, client):
    latencies = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
                assert r.status == 200
            latencies.append(time.perf_counter() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
        for spec in ({"regex": "(a+)+$"}, {"json": huge}):
            try:
                client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                          extra_body={"structured_outputs": spec})
            except openai.BadRequestError as exc:  # over the compile budget: a 400, not a hang
                assert exc.body["param"] == "structured_outputs"
    finally:
        done.set()
        poller.join()
    assert latencies and max(latencies) < 2.0, max(latencies)
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None
