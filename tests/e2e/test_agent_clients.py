"""Two client frameworks a vLLM user points at the server, over a real socket: the OpenAI
Agents SDK (its Responses and Chat Completions models: a run, a streamed run, a forced tool
call and the conversation after it, a typed output, the reasoning and truncation settings)
and LangChain (ChatOpenAI on both APIs, tools, structured output, OpenAIEmbeddings). A regex
grammar (vLLM's structured_outputs) scripts the text where a test needs to know it; tool calls
and typed outputs are held to their schemas by their own grammars."""

import asyncio

import openai
import pydantic
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                    Runner, function_tool, set_tracing_disabled)
from langchain_core.tools import tool as langchain_tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from openai.types.shared import Reasoning

from .server import ServerProcess, regex_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PARIS = "The capital of France is Paris."
SCRIPTED = {"structured_outputs": {"regex": regex_for(PARIS)}}


class Weather(pydantic.BaseModel):
    city: str
    temperature: int


@pytest.fixture(scope="module")
def url(default_model_dir):
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    srv = ServerProcess("--served-model-name", MODEL, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes")
    yield srv.url + "/v1"
    assert srv.stop() == 0


def agent_model(url: str, which: int):
    """The SDK's Responses model (0) or Chat Completions model (1); made inside the event loop
    that uses it, as its client's connections belong to one loop."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    return (OpenAIResponsesModel, OpenAIChatCompletionsModel)[which](MODEL, client)


@pytest.mark.parametrize("which", [0, 1], ids=["responses", "chat"])
def test_agents_sdk_runs_whole_and_streamed(url, which):
    async def main():
        agent = Agent(name="A", instructions="Answer in one sentence.", model=agent_model(url, which),
                      model_settings=ModelSettings(max_tokens=40, temperature=0, extra_body=SCRIPTED))
        whole = await Runner.run(agent, "What is the capital of France?")
        result = Runner.run_streamed(agent, "What is the capital of France?")
        deltas = [event.data.delta async for event in result.stream_events()
                  if event.type == "raw_response_event" and event.data.type == "response.output_text.delta"]
        return whole.final_output, deltas, result.final_output
    whole, deltas, final = asyncio.run(main())
    assert whole == final == PARIS
    assert "".join(deltas) == PARIS and len(deltas) > 1


@pytest.mark.parametrize("which", [0, 1], ids=["responses", "chat"])
def test_agents_sdk_tool_call_and_the_turn_after_it(url, which):
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    async def main():
        model = agent_model(url, which)
        agent = Agent(name="T", instructions="Use the tool.", model=model, tools=[get_weather],
                      tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(max_tokens=80, temperature=0, tool_choice="required"))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=2)
        # the call and its output go back as input items (function_call, function_call_output)
        history = result.to_input_list()
        answer = Agent(name="A", model=model, model_settings=ModelSettings(
            max_tokens=40, temperature=0, extra_body=SCRIPTED))
        after = await Runner.run(answer, history + [{"role": "user", "content": "And the capital?"}])
        return result.final_output, history, after.final_output
    final, history, after = asyncio.run(main())
    assert len(calls) == 1 and isinstance(calls[0], str) and final == f"Sunny in {calls[0]}"
    assert [item.get("type") for item in history[-2:]] == ["function_call", "function_call_output"]
    assert after == PARIS


@pytest.mark.parametrize("which", [0, 1], ids=["responses", "chat"])
def test_agents_sdk_typed_output(url, which):
    async def main():
        agent = Agent(name="S", instructions="Reply in JSON.", model=agent_model(url, which),
                      output_type=Weather, model_settings=ModelSettings(max_tokens=80, temperature=0))
        return (await Runner.run(agent, "The weather in Paris, as JSON.")).final_output
    out = asyncio.run(main())
    assert isinstance(out, Weather) and isinstance(out.temperature, int)


def test_agents_sdk_reasoning_and_truncation_settings(url):
    """What Agents SDK examples set for reasoning models: a summary (the reasoning itself,
    with --reasoning-parser; none here) and truncation "auto"."""
    async def main():
        agent = Agent(name="R", model=agent_model(url, 0), model_settings=ModelSettings(
            max_tokens=40, temperature=0, truncation="auto", extra_body=SCRIPTED,
            reasoning=Reasoning(effort="low", summary="auto"), metadata={"run": "1"}, store=True))
        first = await Runner.run(agent, "What is the capital of France?")
        later = await Runner.run(agent, "Again.", previous_response_id=first.last_response_id)
        return first, later
    first, later = asyncio.run(main())
    assert first.final_output == later.final_output == PARIS
    assert first.last_response_id.startswith("resp_")


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_chat_model(url, responses_api):
    llm = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_tokens=40, temperature=0,
                     max_retries=0, use_responses_api=responses_api)
    scripted = llm.bind(extra_body=SCRIPTED)
    assert scripted.invoke("What is the capital of France?").text == PARIS
    streamed = "".join(chunk.text for chunk in scripted.stream("What is the capital of France?"))
    assert streamed == PARIS

    @langchain_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    typed = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_tokens=80, temperature=0,
                       max_retries=0, use_responses_api=responses_api)
    weather = typed.with_structured_output(Weather, method="json_schema").invoke("Paris weather, as JSON.")
    assert isinstance(weather, Weather)


def test_langchain_embeddings_equal_the_routes_vectors(url):
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    # check_embedding_ctx_length=False: LangChain's default tokenizes with tiktoken (OpenAI's
    # ids, and a download) and sends those ids; docs/serving.md says so
    langchain = OpenAIEmbeddings(model=MODEL, base_url=url, api_key="unused",
                                 check_embedding_ctx_length=False)
    vectors = langchain.embed_documents(texts)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    expected = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts).data]
    assert len(vectors) == 2 and all(len(v) == len(e) for v, e in zip(vectors, expected))
    assert max(abs(a - b) for v, e in zip(vectors, expected) for a, b in zip(v, e)) < 1e-6
    assert langchain.embed_query(texts[1]) == pytest.approx(expected[1], abs=1e-6)
