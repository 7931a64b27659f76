"""A Responses request -> the OpenAI chat body that serves it (its input items read as chat
messages by items.py, for the prompt and for the store that later turns build on).

    input (a string, or items)      messages: a string is one user message; items as
                                    items.py reads them; a last assistant message of status
                                    incomplete (or in_progress) is continued
                                    (continue_final_message), as vLLM continues it
    instructions                    a system message first (not kept for later turns)
    previous_response_id            that response's conversation (its input, and its output
                                    as the assistant's turn) before this input
    max_output_tokens               max_tokens, capped at the room the prompt leaves in the
                                    model length (vLLM's Responses caps it; chat refuses)
    temperature, top_p              the same
    tools (function tools)          chat tools {"type": "function", "function": {...}}; a
                                    namespace tool's functions named namespace__name (vLLM's
                                    flat names), their calls named back with a namespace;
                                    hosted tools (web_search, file_search, mcp, ...) left out
                                    of the prompt, as vLLM leaves them out (hosted_tools.py);
                                    custom (free-form) tools a 400
    tool_choice                     "auto" | "none" | "required" the same; {"type":
                                    "function", "name"} -> {"type": "function", "function":
                                    {"name"}}; allowed_tools: only the tools it names, in its
                                    mode; one that forces a hosted tool is a 400
    text.format                     response_format: json_schema {name, schema, strict},
                                    json_object, or nothing for text; with a forced tool call
                                    (required, a named function) none: that turn's answer is
                                    the call, the format is for the message after it
    max_tool_calls                  caps built-in (hosted) tool calls, of which there are none
                                    here: checked and echoed
    parallel_tool_calls             the same
    reasoning {"effort", "summary"} reasoning_effort (the chat template's variable); a summary
                                    asked for is the whole reasoning (output.py: no summarizer);
                                    context "current_turn" drops earlier turns' reasoning from
                                    the prompt ("all_turns" and "auto" leave it to the
                                    template); mode "standard" (the only one)
    truncation                      "auto": a conversation too long for the model loses its
                                    oldest exchanges (serving._chat_prompt)
    stream                          stream, with stream_options.include_usage
    background                      the same stream (background.py reads it in a task); it
                                    needs store (vLLM's 400 otherwise)

vLLM's Responses extras (top_k, repetition_penalty, seed, stop, ignore_eos,
structured_outputs, skip_special_tokens, include_stop_str_in_output, logit_bias, priority,
request_id) pass through to the chat path, which reads them as it does on chat. Fields vLLM's
request does not know are ignored with a warning naming them in the log, as on the chat route
and in vLLM (whose request model allows extra fields). OpenAI fields pyserve does not implement
are a 400 naming the field: custom tools, and the rest of OpenAI's stateful features."""

from __future__ import annotations

import json

from pyserve.server.errors import APIError
from pyserve.server.hosted_tools import forced_hosted_tool
from pyserve.server.openai.responses.items import (NAMESPACE_SEPARATOR, continues_last_message,
                                                   current_turn_reasoning, input_messages)
from pyserve.server.request_limits import MAX_TOOLS
from pyserve.server.values import brief, capped, field, log_ignored_fields

# read here (and echoed in the response)
IMPLEMENTED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
               "tool_choice", "text", "stream", "store", "previous_response_id",
               "parallel_tool_calls", "include", "background", "reasoning", "top_logprobs",
               "truncation", "max_tool_calls"}
# vLLM's extra ResponsesRequest fields, handed to the chat path as they are
PASSED_THROUGH = {"top_k", "repetition_penalty", "seed", "stop", "ignore_eos", "structured_outputs",
                  "skip_special_tokens", "include_stop_str_in_output", "logit_bias", "priority",
                  "request_id", "vllm_xargs"}
# accepted; they change nothing in the output (metadata, user, safety_identifier and
# prompt_cache_key are echoed); stream_options holds only include_obfuscation, and pyserve's
# events never carry an obfuscation field
NO_EFFECT = {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
             "stream_options", "background_options", "image", "access_programs",
             "prompt_cache_options", "prompt_cache_retention"}
TRUNCATIONS = ("auto", "disabled")
# what reasoning.summary (or its older name, generate_summary) may ask for
SUMMARIES = ("auto", "concise", "detailed")
# which turns' reasoning the prompt carries
REASONING_CONTEXTS = ("auto", "current_turn", "all_turns")
# OpenAI's service tiers (vLLM's Responses request takes these)
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
# field -> the value that asks for nothing pyserve lacks; anything else is a 400
REFUSED_UNLESS_DEFAULT = {"prompt": None, "conversation": None,
                          "context_management": None,
                          "moderation": None,  # no moderation model here
                          # vLLM's ResponsesRequest fields pyserve does not implement
                          "cache_salt": None, "previous_input_messages": None,
                          "enable_response_messages": False, "mm_processor_kwargs": None,
                          "kv_transfer_params": None}
# why a refused field cannot be honoured, where its name does not say it
_WHY = {"enable_response_messages": "a response carries no input_messages or output_messages "
                                    "(vLLM's lists of the prompt's and the answer's messages)"}
# OpenAI's include values; those of what pyserve never outputs (hosted tools', encrypted reasoning)
# ask for nothing
INCLUDES = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
            "message.input_image.image_url", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs", "reasoning.encrypted_content",
            "message.output_text.logprobs")
# the include value that asks for the output text's token logprobs (top_logprobs many
# alternatives each), as vLLM reads it
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's bounds on metadata
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
# identifiers echoed (and stored) as they come, each at most 64 characters: OpenAI documents
# the bound for safety_identifier and refuses longer prompt_cache_key (and user, which both
# replace) with a 400 of its own
IDENTIFIERS, IDENTIFIER_CHARS = ("user", "safety_identifier", "prompt_cache_key"), 64
# a chat-path error's param -> the Responses field it came from
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
          "reasoning_effort": "reasoning"}


def check_fields(body: dict) -> None:
    """400 for a field pyserve does not implement; a fields vLLM's request does not know are
    ignored with a line in the log naming them, as on the chat route and in vLLM (an SDK's
    newer fields must not break requests)."""
    known = IMPLEMENTED | PASSED_THROUGH | NO_EFFECT | set(REFUSED_UNLESS_DEFAULT)
    unknown = set(body) - known
    log_ignored_fields(unknown)
    _check_reasoning(body.get("reasoning"))
    calls = field(body, "max_tool_calls", int)
    if calls is not None and calls < 1:
        raise APIError(400, f"max_tool_calls must be at least 1, got {calls}", "max_tool_calls")
    if body.get("truncation") not in (None, *TRUNCATIONS):
        raise APIError(400, f"truncation must be \"auto\" or \"disabled\", got "
                       f"{brief(body['truncation'])}", "truncation")
    for name, default in REFUSED_UNLESS_DEFAULT.items():
        if body.get(name) not in (None, default):
            raise APIError(400, f"{name} is not supported by this server"
                           + (f" (only {json.dumps(default)})" if default is not None else "")
                           + (f": {_WHY[name]}" if name in _WHY else ""), name)
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise APIError(400, "include must be a list of strings", "include")
        unknown = [i for i in include if i not in INCLUDES]
        if unknown:
            raise APIError(400, f"include value {brief(unknown[0])} is not one of {', '.join(INCLUDES)}",
                           "include")
    # store null is store true (the default), as vLLM reads it
    if field(body, "background", bool, False) and not field(body, "store", bool, True):
        raise APIError(400, "background can only be used when `store` is true", "background")
    field(body, "service_tier", str)
    for name in IDENTIFIERS:  # echoed as strings, of a bounded length
        value = field(body, name, str)
        if value is not None and len(value) > IDENTIFIER_CHARS:
            raise APIError(400, f"{name} may be at most {IDENTIFIER_CHARS} characters long, got "
                           f"{len(value)}", name)
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise APIError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got "
                       f"{brief(body['service_tier'])}", "service_tier")
    for name in ("background_options", "image", "access_programs", "prompt_cache_options"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise APIError(400, f"{name} must be an object", name)
    # prewarm asks for no output at all: not what this route does
    if (body.get("prompt_cache_options") or {}).get("prewarm"):
        raise APIError(400, "prompt_cache_options.prewarm is not supported by this server (prefix "
                       "caching here is automatic)", "prompt_cache_options")
    _check_metadata(body.get("metadata"))
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_obfuscation"}
                                or not isinstance(options.get("include_obfuscation", False), bool)):
        raise APIError(400, "stream_options may hold only include_obfuscation (a boolean)",
                       "stream_options")


def _check_metadata(metadata) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise APIError(400, "metadata must be an object of string values", "metadata")
    if len(metadata) > METADATA_PAIRS:
        raise APIError(400, f"metadata may hold at most {METADATA_PAIRS} pairs, got {len(metadata)}",
                       "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise APIError(400, f"metadata[{brief(key)}] must be a string, got {brief(value)}", "metadata")
        if len(key) > METADATA_KEY or len(value) > METADATA_VALUE:
            raise APIError(400, f"metadata keys may be at most {METADATA_KEY} characters and values "
                           f"at most {METADATA_VALUE}", "metadata")


def hosted_tools(tools) -> list[str]:
    """The types of the hosted tools in a request's tools (namespace members too): everything
    but function, namespace and custom tools, which are left out of the prompt (hosted_tools.py)."""
    kinds = []
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        members = tool.get("tools") if kind == "namespace" else None
        for member in members if isinstance(members, list) else ():
            inner = member.get("type") if isinstance(member, dict) else None
            if isinstance(inner, str) and _is_hosted(inner):
                kinds.append(inner)
        if isinstance(kind, str) and _is_hosted(kind):
            kinds.append(kind)
    return kinds


def _is_hosted(kind: str) -> bool:
    return kind not in ("function", "namespace", "custom")


def chat_tools(tools) -> list[dict] | None:
    """The function tools (a namespace's named namespace__name), in the chat form; hosted
    tools left out, as vLLM leaves them out; custom (free-form) tools a 400."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list", "tools")
    capped("tools", tools, MAX_TOOLS, "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(kind, str):
            raise APIError(400, f"tools[{i}] must be an object with a type", "tools")
        if kind == "namespace":  # its functions, named namespace__name (vLLM's flat names)
            inner = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(inner, list) or not inner:
                raise APIError(400, f"tools[{i}]: a namespace tool needs a name and a list of tools",
                               "tools")
            for j, member in enumerate(inner):
                member_kind = member.get("type") if isinstance(member, dict) else None
                if member_kind == "function":
                    out.append(_function(member, f"tools[{i}].tools[{j}]",
                                         tool["name"] + NAMESPACE_SEPARATOR))
                elif not isinstance(member_kind, str) or not _is_hosted(member_kind):
                    _refuse_tool(f"tools[{i}].tools[{j}]", member_kind)
            continue
        if kind == "function":
            out.append(_function(tool, f"tools[{i}]"))
        elif not _is_hosted(kind):
            _refuse_tool(f"tools[{i}]", kind)
    return out


def _refuse_tool(at: str, kind) -> None:
    if kind == "custom":
        raise APIError(400, f"{at}: custom (free-form) tools are not supported by this server; "
                       "only function tools are", "tools")
    raise APIError(400, f"{at} must be an object with a type", "tools")


def _function(tool: dict, at: str, prefix: str = "") -> dict:
    """A function tool in the chat form (its name after prefix: a namespace's)."""
    if not isinstance(tool.get("name"), str):
        raise APIError(400, f"{at}: a function tool needs a name", "tools")
    if field(tool, "defer_loading", bool, False):
        raise APIError(400, f"{at}.defer_loading: deferred tools (tool search) are not "
                       "supported by this server", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    function["name"] = prefix + function["name"]
    return {"type": "function", "function": function}


def _qualified_names(choice, namespaces: dict[str, tuple[str, str]]):
    """A chat-form tool_choice whose function names a namespace's as namespace.name (the
    Agents SDK's qualified name) with their flat chat names instead."""
    flat = {f"{ns}.{name}": flat for flat, (ns, name) in namespaces.items()}
    if not flat or not isinstance(choice, dict):
        return choice
    named = [choice.get("function")] if choice.get("type") == "function" else [
        t.get("function") for t in (choice.get("allowed_tools") or {}).get("tools") or []
        if isinstance(t, dict)]
    for function in named:
        if isinstance(function, dict) and function.get("name") in flat:
            function["name"] = flat[function["name"]]
    return choice


def namespaced_names(tools) -> dict[str, tuple[str, str]]:
    """A request's namespace tools' flat names -> (namespace, name), to name its calls back."""
    out = {}
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for member in tool["tools"]:
                if isinstance(member, dict) and isinstance(member.get("name"), str):
                    out[tool["name"] + NAMESPACE_SEPARATOR + member["name"]] = (tool["name"], member["name"])
    return out


def chat_tool_choice(choice, has_tools: bool):
    if choice is None or (choice == "auto" and not has_tools):
        return None  # "auto" without tools asks for nothing
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        # the chat form, which the chat path reads and checks: {"type": "function", "name"}
        # entries become {"type": "function", "function": {"name"}}; anything else goes as it is;
        # hosted tools' entries are left out with the tools (required with only those: a 400)
        spec = {key: value for key, value in choice.items() if key != "type"}
        if isinstance(spec.get("tools"), list):
            listed = spec["tools"]
            spec["tools"] = [{"type": t.get("type"), "function": {"name": t.get("name")}}
                             if isinstance(t, dict) else t for t in listed
                             if not (isinstance(t, dict) and isinstance(t.get("type"), str)
                                     and _is_hosted(t["type"]))]
            if listed and not spec["tools"] and spec.get("mode") == "required":
                raise APIError(400, forced_hosted_tool(brief(listed[0]["type"]), "tool_choice"),
                               "tool_choice")
            if listed and not spec["tools"]:
                return "none"  # auto among hosted tools alone: nothing the model can call
        return {"type": "allowed_tools", "allowed_tools": spec}
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and _is_hosted(kind):
        raise APIError(400, forced_hosted_tool(brief(kind), "tool_choice"), "tool_choice")
    if isinstance(kind, str) and kind != "function":
        raise APIError(400, f"tool_choice type {brief(kind)} is not supported by this server; only "
                       "function tools are", "tool_choice")
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or '
                   '{"type": "function", "name": ...}', "tool_choice")


def forces_a_call(choice) -> bool:
    """Whether a (chat-form) tool_choice makes the answer a tool call."""
    if choice == "required":
        return True
    if not isinstance(choice, dict):
        return False
    return choice.get("type") == "function" or (choice.get("allowed_tools") or {}).get("mode") == "required"


def response_format(text) -> dict | None:
    """text.format -> the chat path's response_format (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise APIError(400, "text must be an object with format (and verbosity)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format json_schema needs a schema (an object)", "text")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(400, f"text.format type {brief(kind)} is not one of text, json_object, json_schema",
                   "text")


def _check_reasoning(reasoning) -> None:
    """reasoning {"effort"}: the chat path's reasoning_effort (a template variable); summary
    (or generate_summary): one of SUMMARIES."""
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise APIError(400, "reasoning must be an object", "reasoning")
    for key, value in reasoning.items():
        if key not in ("effort", "summary", "generate_summary", "context", "mode"):
            raise APIError(400, f"reasoning.{brief(key)} is not a reasoning field", "reasoning")
        if key == "context" and value not in (None, *REASONING_CONTEXTS):
            raise APIError(400, f"reasoning.context must be one of {', '.join(REASONING_CONTEXTS)}, "
                           f"got {brief(value)}", "reasoning")
        if key == "mode" and value not in (None, "standard"):
            raise APIError(400, f"reasoning.mode {brief(value)} is not supported by this server "
                           "(only \"standard\")", "reasoning")
        if key in ("summary", "generate_summary") and value not in (None, *SUMMARIES):
            raise APIError(400, f"reasoning.{key} must be one of {', '.join(SUMMARIES)}, got "
                           f"{brief(value)}", "reasoning")


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat body, the conversation so far as chat messages: history plus this input,
    without the instructions)."""
    check_fields(body)
    if "input" not in body:
        raise APIError(400, "input is required", "input")
    conversation = history + input_messages(body["input"])
    instructions = field(body, "instructions", str)
    shown = conversation
    if (body.get("reasoning") or {}).get("context") == "current_turn":
        shown = current_turn_reasoning(conversation)
    chat: dict = {"messages": ([{"role": "system", "content": instructions}] if instructions else [])
                  + shown}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    max_output = field(body, "max_output_tokens", int)
    if max_output is not None:
        if max_output < 1:
            raise APIError(400, f"max_output_tokens must be at least 1, got {max_output}",
                           "max_output_tokens")
        chat["max_tokens"] = max_output
    if (body.get("reasoning") or {}).get("effort") is not None:
        chat["reasoning_effort"] = body["reasoning"]["effort"]  # checked by the chat path
    top = field(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= 20:
        raise APIError(400, f"top_logprobs must be between 0 and 20, got {top}", "top_logprobs")
    if LOGPROBS_INCLUDE in (body.get("include") or []):  # vLLM: logprobs only when included
        chat["logprobs"], chat["top_logprobs"] = True, top or 0
    for name in ("temperature", "top_p", "parallel_tool_calls", *sorted(PASSED_THROUGH)):
        if body.get(name) is not None:
            chat[name] = body[name]
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    hosted = hosted_tools(body.get("tools"))
    if body.get("tool_choice") == "required" and hosted and not tools:
        raise APIError(400, forced_hosted_tool(brief(hosted[0]), "tool_choice \"required\""),
                       "tool_choice")
    choice = _qualified_names(chat_tool_choice(body.get("tool_choice"), bool(tools)),
                              namespaced_names(body.get("tools")))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = response_format(body.get("text"))
    if fmt is not None and not forces_a_call(choice):
        chat["response_format"] = fmt
    if continues_last_message(body["input"]):
        chat["add_generation_prompt"], chat["continue_final_message"] = False, True
    if field(body, "stream", bool, False) or field(body, "background", bool, False):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    # a --reasoning-parser's thinking comes back as a reasoning item, as vLLM returns it
    chat["include_reasoning"] = True
    return chat, conversation
