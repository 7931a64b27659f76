"""What vLLM's own server tests (tool calling, structured outputs, the Responses API, pooling,
the Messages API) caught when run against pyserve (issue 70), each checked here through the
openai and anthropic SDKs over a real socket, on the default model: `$defs` under
tool_choice "required", forced calls cut by max_tokens, template paths that are no file,
Anthropic's block validation, --enable-force-include-usage, --root-path, vLLM's error words,
chat prompt_token_ids, SageMaker's /invocations for scores and reranking, and the fields still
refused with the reason."""

import json

import anthropic
import jsonschema
import openai
import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "parity-key"
ROOT = "/llm"

# a tool whose parameters refer to their own $defs, beside a second tool (vLLM's test shape),
# both small: a 135M model on a shared CPU writes their calls in a few dozen tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "$defs": {"Unit": {"enum": ["c", "f"]}},
                   "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
                   "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two digits",
    "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                   "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--api-key", KEY, "--root-path", ROOT,
                        "--enable-force-include-usage")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def root(server):
    """The SDK at the server's root, for routes outside /v1 (the SDK posts to any path)."""
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)


def ask(content):
    return [{"role": "user", "content": content}]


def _check_call(call, tools):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


# -- $defs under tool_choice "required" -----------------------------------------------------------
def test_required_tools_keep_each_tools_defs_on_chat(client):
    """vLLM hoists each tool's $defs to the combined schema's root; before, the grammar could
    not resolve "#/$defs/Unit" (a 400)."""
    choice = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Rome?"), tools=[WEATHER, ADD], tool_choice="required",
        temperature=0, max_tokens=80).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for call in choice.message.tool_calls:
        _check_call(call, [WEATHER, ADD])


def test_required_tools_keep_each_tools_defs_on_responses(client):
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, ADD)]
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=tools,
                                tool_choice="required", temperature=0, max_output_tokens=80)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, r.output
    for call in calls:
        jsonschema.validate(json.loads(call.arguments),
                            next(t["parameters"] for t in tools if t["name"] == call.name))


def test_two_tools_defining_one_name_differently_are_vllms_400(client):
    other = json.loads(json.dumps(ADD))
    other["function"]["parameters"]["$defs"] = {"Unit": {"type": "string"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), tools=[WEATHER, other],
                                       tool_choice="required", max_tokens=5)
    assert err.value.body["message"] == ("Tool definition 'Unit' has multiple schemas, "
                                         "which is not supported.")
    assert err.value.body["param"] == "tools"


# -- a forced call cut by max_tokens ---------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_no_call(client, tool_choice):
    """vLLM's test_max_tokens_with_tool_choice_required: finish_reason "length", no calls (half
    a JSON object is not a call anyone can run), streamed or not."""
    args = dict(model=MODEL, messages=ask("Weather in Rome?"), tools=[WEATHER, ADD],
                tool_choice=tool_choice, temperature=0, max_completion_tokens=2)
    choice = client.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls and not choice.message.content
    finish, deltas = None, []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            deltas += chunk.choices[0].delta.tool_calls or []
            assert not chunk.choices[0].delta.content
    assert finish == "length" and deltas == []


def test_a_named_call_that_ends_streams_whole_and_equal(client):
    args = dict(model=MODEL, messages=ask("Weather in Rome?"), tools=[WEATHER, ADD],
                tool_choice=NAMED, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**args).choices[0]
    [call] = whole.message.tool_calls
    assert whole.finish_reason == "stop"
    _check_call(call, [WEATHER])
    streamed = [d for chunk in client.chat.completions.create(**args, stream=True)
                if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in streamed if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in streamed) == call.function.arguments


def test_anthropic_forced_tool_cut_by_max_tokens_is_no_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    tool = {"name": "add", "input_schema": ADD["function"]["parameters"]}
    out = client.messages.create(model=MODEL, max_tokens=1, tools=[tool],
                                 tool_choice={"type": "tool", "name": "add"},
                                 messages=[{"role": "user", "content": "Add 2 and 3."}])
    assert out.stop_reason == "max_tokens"
    assert [b.type for b in out.content if b.type == "tool_use"] == []


# -- --chat-template that looks like a path ---------------------------------------------------------
def test_a_chat_template_path_that_is_no_file_refuses_to_start(default_model_dir, tmp_path):
    with pytest.raises(RuntimeError) as err:
        ServerProcess("--chat-template", "../../examples/does_not_exist", timeout=60)
    output = str(err.value)
    assert "--chat-template" in output and "looks like a file path" in output
    assert "does_not_exist" in output


# -- Anthropic content blocks -----------------------------------------------------------------------
CALL = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}


@pytest.mark.parametrize("assistant, result, where", [
    ([{**CALL, "id": ""}], [RESULT], "messages[1].content[0].id"),
    ([{**CALL, "name": ""}], [RESULT], "messages[1].content[0].name"),
    ([{k: v for k, v in CALL.items() if k != "input"}], [RESULT], "messages[1].content[0].input"),
    ([CALL], [{**RESULT, "tool_use_id": ""}], "messages[2].content[0].tool_use_id"),
    ([{"type": "redacted_thinking"}, CALL], [RESULT], "messages[1].content[0].data"),
    ([{"type": "redacted_thinking", "data": ""}, CALL], [RESULT], "messages[1].content[0].data"),
], ids=["tool_use-empty-id", "tool_use-empty-name", "tool_use-no-input",
        "tool_result-empty-id", "redacted-no-data", "redacted-empty-data"])
def test_anthropic_blocks_vllm_rejects_are_a_400_naming_the_block(server, assistant, result, where):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "Add 1 and 2."}, {"role": "assistant", "content": assistant},
                {"role": "user", "content": result}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=messages)
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(where + ": ")


def test_the_same_blocks_whole_are_a_conversation(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    fine = [{"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "opaque"}, CALL]},
            {"role": "user", "content": [RESULT]}]
    assert client.messages.create(model=MODEL, max_tokens=1, messages=fine).usage.output_tokens == 1


# -- --enable-force-include-usage and --root-path ---------------------------------------------------
def test_force_include_usage_ends_every_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ask("Say hi."), max_tokens=4,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])  # final usage only, as vLLM's default
    text = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert text[-1].usage is not None and text[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("base", ["/v1", ROOT + "/v1"])
def test_root_path_and_the_bare_path_both_serve(server, base):
    """vLLM's test_root_path: with --root-path /llm, /llm/v1 and /v1 both answer, and both ask
    for the API key."""
    good = openai.OpenAI(base_url=server.url + base, api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": "tell me a common saying"},
        {"role": "assistant", "content": "An apple a day, keeps"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    bad = openai.OpenAI(base_url=server.url + base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# -- vLLM's error words -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["encoding_format", "embed_dtype", "endianness"])
def test_an_enum_field_outside_its_values_is_pydantics_literal_error(root, name):
    """vLLM's test_params_not_supported: 400, "literal_error" and the value in the message."""
    body = {"model": MODEL, "input": "a sentence", "encoding_format": "base64", name: f"bad_{name}"}
    for path in ("/v1/embeddings", "/pooling"):
        with pytest.raises(openai.BadRequestError) as err:
            root.post(path, body=body, cast_to=object)
        message = err.value.body["message"]
        assert "literal_error" in message and f"bad_{name}" in message and "Input should be" in message
        assert err.value.body["param"] == name


@pytest.mark.parametrize("task", ["classify", "token_classify", "plugin"])
def test_an_unsupported_pooling_task_is_vllms_message(root, task):
    with pytest.raises(openai.BadRequestError) as err:
        root.post("/pooling", body={"model": MODEL, "input": "test", "encoding_format": "float",
                                    "task": task}, cast_to=object)
    assert err.value.body["type"] == "BadRequestError"
    assert err.value.body["message"].startswith(f"Unsupported task: {task!r}")


# -- feature gaps: built ----------------------------------------------------------------------------
def test_chat_prompt_token_ids_are_the_prompt_as_given(root, client):
    messages = ask("Name a colour.")
    ids = root.post("/tokenize", body={"model": MODEL, "messages": messages}, cast_to=object)["tokens"]
    rendered = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                              temperature=0)
    given = client.chat.completions.create(model=MODEL, messages=ask("ignored: the ids are the prompt"),
                                           max_tokens=6, temperature=0,
                                           extra_body={"prompt_token_ids": ids})
    assert given.choices[0].message.content == rendered.choices[0].message.content
    assert given.usage.prompt_tokens == rendered.usage.prompt_tokens == len(ids)
    for bad in ([], [10**9], ["a"]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body={"prompt_token_ids": bad})
        assert err.value.body["param"] == "prompt_token_ids"


def test_scores_and_reranking_through_invocations(root):
    """vLLM's pooling servers send /score's and /rerank's bodies from SageMaker's entry point."""
    rerank = {"model": MODEL, "query": "What is the capital of France?",
              "documents": ["Paris is the capital of France.", "Bananas are yellow."]}
    direct = root.post("/rerank", body=rerank, cast_to=object)
    through = root.post("/invocations", body=rerank, cast_to=object)
    assert [r["index"] for r in through["results"]] == [r["index"] for r in direct["results"]]
    assert [r["relevance_score"] for r in through["results"]] == pytest.approx(
        [r["relevance_score"] for r in direct["results"]], abs=1e-5)
    score = {"model": MODEL, "text_1": "What is the capital of France?",
             "text_2": "The capital of France is Paris."}
    direct = root.post("/score", body=score, cast_to=object)
    through = root.post("/invocations", body=score, cast_to=object)
    assert through.keys() == direct.keys()
    assert through["data"][0]["score"] == pytest.approx(direct["data"][0]["score"], abs=1e-5)


# -- feature gaps: refused with the reason ----------------------------------------------------------
def test_logprob_token_ids_is_refused_saying_why(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2,
                                       extra_body={"logprob_token_ids": [1, 2]})
    assert err.value.body["param"] == "logprob_token_ids"
    assert "top_logprobs" in err.value.body["message"]


def test_enable_response_messages_is_refused_saying_why(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=4,
                                extra_body={"enable_response_messages": True})
    assert err.value.body["param"] == "enable_response_messages"
    assert "input_messages" in err.value.body["message"]
