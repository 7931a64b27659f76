"""Run inside LiteLLM's own environment (installs.py) by test_litellm.py: the calls a LiteLLM
user makes against a vLLM-compatible server, each printed as one JSON line for the test to
check. argv: the server's URL, its API key, the served model name, the scripted text."""

import json
import sys

import litellm

url, key, model, scripted = sys.argv[1:5]
litellm.telemetry = False
OPENAI = dict(model=f"hosted_vllm/{model}", api_base=f"{url}/v1", api_key=key, temperature=0,
              max_tokens=40, num_retries=0)
ASK = [{"role": "user", "content": "What is the capital of France?"}]
SCRIPT = {"structured_outputs": {"regex": scripted}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer"}, "b": {"type": "integer"}},
                                            "required": ["a", "b"]}}}


def emit(name, **fields):
    print(json.dumps({"name": name, **fields}), flush=True)


def calls(message):
    return [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
            for c in message.tool_calls or []]


whole = litellm.completion(messages=ASK, extra_body=SCRIPT, **OPENAI)
emit("completion", text=whole.choices[0].message.content, finish=whole.choices[0].finish_reason,
     usage=whole.usage.completion_tokens)
pieces = [chunk.choices[0].delta.content or "" for chunk in
          litellm.completion(messages=ASK, extra_body=SCRIPT, stream=True, **OPENAI) if chunk.choices]
emit("stream", text="".join(pieces))

hermes = '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>'
hermes_regex = "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in hermes)
for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}):
    extra = {"structured_outputs": {"regex": hermes_regex}} if choice == "auto" else {}
    # one call under "required": this model repeats the list's item until max_tokens otherwise
    one = {"parallel_tool_calls": False} if choice == "required" else {}
    # the hermes text in whatever tokens the model picks under the regex: more than 40
    room = {"max_tokens": 160} if choice == "auto" else {}
    out = litellm.completion(messages=[{"role": "user", "content": "Add 12 and 30."}], tools=[ADD],
                             tool_choice=choice, extra_body=extra, **one, **{**OPENAI, **room}).choices[0]
    emit(f"tools {choice if isinstance(choice, str) else 'named'}", calls=calls(out.message),
         finish=out.finish_reason)
    if choice == "required":  # the round trip: the call's result back, then the answer
        first = calls(out.message)[0]
        history = [{"role": "user", "content": "Add 12 and 30."}, out.message.model_dump(),
                   {"role": "tool", "tool_call_id": first["id"], "content": "42"}]
        answer = litellm.completion(messages=history, tools=[ADD], extra_body=SCRIPT, **OPENAI)
        emit("tool round trip", text=answer.choices[0].message.content)

claude = litellm.completion(model=f"anthropic/{model}", api_base=url, api_key=key, messages=ASK,
                            max_tokens=40, temperature=0, extra_body=SCRIPT, num_retries=0)
emit("anthropic", text=claude.choices[0].message.content, finish=claude.choices[0].finish_reason)

response = litellm.responses(model=f"openai/{model}", api_base=f"{url}/v1", api_key=key,
                             input="What is the capital of France?", max_output_tokens=40,
                             temperature=0, extra_body=SCRIPT)
emit("responses", text=response.output[0].content[0].text, status=response.status)
