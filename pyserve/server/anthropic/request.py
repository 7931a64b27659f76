"""An Anthropic Messages request -> the OpenAI chat body `OpenAIServing.chat_result` reads.

    system (a string or text blocks)      a system message
    messages[].content (string | blocks)  text blocks -> text parts (joined with newlines, as
                                          the chat path joins them); an assistant's tool_use
                                          blocks -> its tool_calls (arguments as JSON text); a
                                          user's tool_result blocks -> role "tool" messages
                                          (tool_call_id), in order with its text
    messages[].role ctx, msg              user (roles recent Claude Code sends)
    messages[].role system                before the first user or assistant message: joins
                                          the system prompt; later (a reminder in the middle
                                          of a conversation): its text is given as user text
                                          where it stands, after that turn's tool results, so
                                          that templates which take one leading system
                                          message render it and earlier turns stay a prefix
    system text x-anthropic-billing-header: ...  dropped (Claude Code's per-request billing
                                          line: it would change every prompt's first tokens
                                          and defeat prefix caching; it means nothing to a
                                          model)
    an assistant's thinking blocks        its reasoning_content (templates that render past
                                          reasoning read it); redacted_thinking: dropped
    tool_result is_error true             its text prefixed with "Error: "
    context_management clear_thinking_20251015  past turns' reasoning_content dropped but for
                                          the last `keep` (1 by default, or "all"); its
                                          other edits: a 400
    consecutive turns of one role         one turn, as Anthropic combines them (parts and
                                          tool_calls joined)
    a final assistant message             a prefill: continue_final_message, no generation prompt
    max_tokens (required)                 max_tokens
    stop_sequences                        stop
    temperature, top_p, top_k             the same
    stream                                stream, with stream_options include_usage
    tools {name, description, input_schema}  function tools {name, description, parameters};
                                          strict -> the function's strict (as on the chat
                                          route), input_examples -> appended to the
                                          description as JSON lines, eager_input_streaming
                                          accepted (input_json_delta is always streamed),
                                          defer_loading false accepted (true: tool search,
                                          a 400); server tools (a type other than custom:
                                          web_search_20250305, mcp_toolset, ...) left out of
                                          the prompt (hosted_tools.py)
    tool_choice auto | any | tool | none  "auto" | "required" | a named function | "none";
                                          disable_parallel_tool_use -> parallel_tool_calls false
    thinking enabled | adaptive           the chat template's enable_thinking true (set by
                                          chat_template_kwargs wins) and the reasoning kept:
                                          with --reasoning-parser it comes back as a thinking
                                          block (its signature "pyserve", checked by no one).
                                          budget_tokens is checked as Anthropic checks it (at
                                          least 1,024, below max_tokens) and is not a separate
                                          limit here: thinking and text share max_tokens
    thinking disabled                     enable_thinking false; absent: the template's own
                                          default, any reasoning left out of the answer
    output_config.format (json_schema)    response_format json_schema (structured outputs)
    output_config.effort                  the chat template's reasoning_effort variable
    metadata, service_tier, speed,        accepted: they change nothing (cache_control on a
    user_profile_id, workspace_id,        block too: prefix caching here is automatic)
    inference_geo, cache_control

pyserve's own sampling and structured-output fields (vLLM's extras, e.g. `structured_outputs`)
pass through with their chat meaning. A 400 names what this server cannot honour: images and
documents (the models served take text only), a tool_choice that forces a server tool, REFUSED below
(MCP servers, containers, OpenAI chat fields that would change the answer). Other unknown
fields are ignored with a warning naming them in the log, as vLLM ignores them. Errors are
APIError(400, message, param), with Anthropic's field names."""

from __future__ import annotations

import json

from pyserve.server.anthropic.conversation import check_keys, conversation, fail
from pyserve.server.errors import APIError
from pyserve.server.hosted_tools import forced_hosted_tool
from pyserve.server.request_limits import MAX_MESSAGES, MAX_STOP, MAX_STOP_CHARS, MAX_TOOLS
from pyserve.server.values import brief, field, log_ignored_fields

# vLLM's extras to the chat request, read by the chat path as on /v1/chat/completions
PASSTHROUGH = ("structured_outputs", "seed", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "min_tokens", "chat_template_kwargs", "ignore_eos")
# Anthropic's fields pyserve cannot honour, and OpenAI chat fields sent here by mistake that
# would change the answer: a 400 naming them. Any other unknown field is ignored with a warning
# naming it in the log, as vLLM's Anthropic request model ignores extra fields (an SDK's newer
# fields must not break requests).
REFUSED = frozenset(("mcp_servers", "container", "n", "logprobs",
                     "top_logprobs", "stop", "response_format", "max_completion_tokens", "best_of",
                     "logit_bias", "stop_token_ids", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "allowed_token_ids", "bad_words", "prompt_logprobs",
                     "include_stop_str_in_output", "functions", "function_call"))
NO_EFFECT = ("metadata", "service_tier", "speed", "user_profile_id", "workspace_id", "inference_geo",
             "cache_control")
_PROMPT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control",
                  "context_management",
                  "speed", "user_profile_id", "workspace_id", "output_config", "output_format"}
FIELDS = {
    "messages": _PROMPT_FIELDS | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                                  "stream", *NO_EFFECT, *PASSTHROUGH},
    "count_tokens": _PROMPT_FIELDS | {"chat_template_kwargs", *NO_EFFECT},
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
THINKING_SIGNATURE = "pyserve"  # a thinking block's signature: nothing here checks it


def server_tools(tools) -> dict[str, str]:
    """A request's server tools (any tool with a type other than custom: web_search_20250305,
    mcp_toolset, ...): name (or type, for one without a name) -> type. They are left out of
    the prompt (hosted_tools.py)."""
    out = {}
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            kind = kind if isinstance(kind, str) else brief(kind)
            name = tool.get("name")
            out[name if isinstance(name, str) else kind] = kind
    return out


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        fail("tools", "must be a list")
    if len(tools) > MAX_TOOLS:
        fail("tools", f"may hold at most {MAX_TOOLS} tools, got {len(tools)}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            fail(where, "must be an object")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool: left out of the prompt (server_tools names it)
        check_keys(tool, where, {"type", "name", "description", "input_schema", "strict",
                                  "input_examples", "eager_input_streaming", "defer_loading"})
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            fail(f"{where}.name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            fail(f"{where}.input_schema", "must be a JSON schema object")
        field(tool, "eager_input_streaming", bool)  # input_json_delta is streamed either way
        if field(tool, "defer_loading", bool, False):
            fail(f"{where}.defer_loading", "deferred tools (tool search) are not supported by "
                  "this server")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        description = tool.get("description")
        examples = tool.get("input_examples")
        if examples is not None:
            if not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples):
                fail(f"{where}.input_examples", "must be a list of objects")
            lines = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
            description = f"{description or ''}\n\nExample inputs:\n{lines}".lstrip("\n")
        if description is not None:
            function["description"] = description
        if tool.get("strict") is not None:
            function["strict"] = field(tool, "strict", bool)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice, body: dict, left_out: dict[str, str]) -> None:
    """left_out: the server tools left out of the prompt (a choice that forces one is a 400)."""
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        fail("tool_choice", "must be an object with a type: auto, any, tool or none")
    kind = choice["type"]
    if left_out and not body.get("tools"):  # every tool was a server tool, left out
        if kind == "any":
            fail("tool_choice", forced_hosted_tool(brief(next(iter(left_out.values()))), "tool_choice any"))
        if kind in ("auto", "none"):
            return  # nothing left to choose among
    if kind == "tool":
        check_keys(choice, "tool_choice", {"type", "name", "disable_parallel_tool_use"})
        if not isinstance(choice.get("name"), str) or not choice["name"]:  # vLLM's words
            fail("tool_choice.name", "tool_choice.name is required when type is 'tool'")
        if choice["name"] in left_out:
            fail("tool_choice.name", forced_hosted_tool(f"{brief(choice['name'])} "
                                                        f"({brief(left_out[choice['name']])})", "tool_choice"))
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in _TOOL_CHOICES:
        allowed = {"type"} if kind == "none" else {"type", "disable_parallel_tool_use"}
        check_keys(choice, "tool_choice", allowed)
        body["tool_choice"] = _TOOL_CHOICES[kind]
    else:
        fail("tool_choice.type", f"must be auto, any, tool or none, got {brief(kind)}")
    if field(choice, "disable_parallel_tool_use", bool, False):
        body["parallel_tool_calls"] = False


def _output_config(config, body: dict) -> None:
    """output_config: format {"type": "json_schema", "schema"} -> the chat path's json_schema
    response_format (the SDK's messages.parse sends it); effort -> the chat template's
    reasoning_effort variable, as the chat route's reasoning_effort (templates that take an
    effort read it; chat_template_kwargs' own value wins)."""
    if config is None:
        return
    if not isinstance(config, dict):
        fail("output_config", "must be an object")
    check_keys(config, "output_config", {"format", "effort"})
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
                or not isinstance(fmt.get("schema"), dict):
            fail("output_config.format", "must be {\"type\": \"json_schema\", \"schema\": {...}}")
        check_keys(fmt, "output_config.format", {"type", "schema"})
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"]}}
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            fail("output_config.effort", f"must be low, medium, high, xhigh or max, got {brief(effort)}")
        kwargs = _template_kwargs(body)
        kwargs.setdefault("reasoning_effort", effort)
        body["chat_template_kwargs"] = kwargs


def _context_management(management, chat: list[dict]) -> None:
    """context_management's clear_thinking_20251015 edit (the one Claude Code sends): past
    assistant turns' thinking is dropped but for the last `keep` turns that have some
    (Anthropic's default: 1; "all" keeps every one). Other edits (clearing tool results at a
    token threshold, compaction) are a 400."""
    if management is None:
        return
    if not isinstance(management, dict) or not isinstance(management.get("edits"), list):
        fail("context_management", "must be {\"edits\": [...]}")
    check_keys(management, "context_management", {"edits"})
    for i, edit in enumerate(management["edits"]):
        where = f"context_management.edits[{i}]"
        if not isinstance(edit, dict) or edit.get("type") != "clear_thinking_20251015":
            kind = edit.get("type") if isinstance(edit, dict) else None
            fail(f"{where}.type", f"only clear_thinking_20251015 is supported by this server, got {brief(kind)}")
        check_keys(edit, where, {"type", "keep"})
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep == "all":
            continue
        if not isinstance(keep, dict) or keep.get("type") != "thinking_turns" \
                or not isinstance(keep.get("value"), int) or isinstance(keep["value"], bool) \
                or keep["value"] < 0:
            fail(f"{where}.keep", "must be \"all\" or {\"type\": \"thinking_turns\", \"value\": N}")
        thinking = [m for m in chat if m["role"] == "assistant" and m.get("reasoning_content")]
        for message in thinking[:len(thinking) - keep["value"]]:
            del message["reasoning_content"]


def _template_kwargs(body: dict) -> dict:
    """A copy of the body's chat_template_kwargs (passed through from the request), to add to."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        fail("chat_template_kwargs", "must be an object")
    return dict(kwargs or {})


def _thinking(thinking, body: dict, max_tokens: int | None) -> None:
    """thinking -> the template's enable_thinking (chat_template_kwargs' own value wins) and
    whether the answer keeps the reasoning."""
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "adaptive", "disabled"):
        fail("thinking", "must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
              "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}")
    kind = thinking["type"]
    check_keys(thinking, "thinking", {"type", "budget_tokens", "display"} if kind == "enabled"
                else {"type", "display"} if kind == "adaptive" else {"type"})
    if thinking.get("display") not in (None, "summarized", "omitted"):
        fail("thinking.display", f"must be summarized or omitted, got {brief(thinking['display'])}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is None:
            fail("thinking.budget_tokens", "Field required")
        if not isinstance(budget, int) or isinstance(budget, bool):
            fail("thinking.budget_tokens", f"must be an integer, got {brief(budget)}")
        if budget < 1024:
            fail("thinking.budget_tokens", f"must be at least 1024, got {budget}")
        if max_tokens is not None and budget >= max_tokens:
            fail("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    enabled = kind != "disabled"
    kwargs = _template_kwargs(body)
    kwargs.setdefault("enable_thinking", enabled)
    body["chat_template_kwargs"] = kwargs
    # display "omitted" too: the thinking block comes back, its text left empty (response.py)
    body["include_reasoning"] = enabled


def thinking_omitted(request: dict) -> bool:
    """thinking.display "omitted": thinking blocks carry their signature, not their text."""
    thinking = request.get("thinking")
    return isinstance(thinking, dict) and thinking.get("display") == "omitted"


def chat_body(request, route: str = "messages") -> tuple[dict, list[str]]:
    """(the chat body, the stop sequences) for a /v1/messages request, or (route
    "count_tokens") the body whose rendered prompt /v1/messages/count_tokens counts."""
    if not isinstance(request, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = set()
    for name in request:
        if name not in FIELDS[route] and request[name] is not None:
            # count_tokens counts a prompt: a generation field there is a client's mistake
            if name in REFUSED or (name in FIELDS["messages"] and name not in NO_EFFECT):
                fail(name, "this field is not supported by this server")
            unknown.add(name)
    log_ignored_fields(unknown)
    model = request.get("model")
    if model is not None and not isinstance(model, str):
        fail("model", "must be a string")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        fail("messages", "must be a non-empty list")
    if len(messages) > MAX_MESSAGES:  # before any is translated
        fail("messages", f"may hold at most {MAX_MESSAGES} messages, got {len(messages)}")
    chat = conversation(request.get("system"), messages)
    _context_management(request.get("context_management"), chat)
    # reasoning (with --reasoning-parser) is kept only where thinking is asked for
    body: dict = {"model": model, "messages": chat, "include_reasoning": False}
    if chat[-1]["role"] == "assistant":  # Anthropic's prefill: the answer continues it
        if chat[-1].get("tool_calls"):
            fail(f"messages[{len(messages) - 1}]", "a final assistant message cannot end with "
                  "tool_use: send its tool_result in a user message")
        body["add_generation_prompt"], body["continue_final_message"] = False, True
    if request.get("tools") is not None:
        tools = _tools(request["tools"])
        if tools:  # Anthropic takes an empty list as no tools (chat, vLLM's check, refuses it)
            body["tools"] = tools
    if request.get("tool_choice") is not None:
        _tool_choice(request["tool_choice"], body, server_tools(request.get("tools")))
    for name in PASSTHROUGH:
        if request.get(name) is not None and name in FIELDS[route]:
            body[name] = request[name]
    _output_config(request.get("output_config"), body)
    if request.get("output_format") is not None:  # the structured-outputs beta's name for it
        if (request.get("output_config") or {}).get("format") is not None:
            fail("output_format", "give output_config.format or output_format, not both")
        _output_config({"format": request["output_format"]}, body)
    if route == "count_tokens":
        _thinking(request.get("thinking"), body, None)
        return body, []
    max_tokens = field(request, "max_tokens", int)
    if max_tokens is None:
        fail("max_tokens", "Field required")
    if max_tokens < 1:  # vLLM's words
        fail("max_tokens", f"max_tokens must be positive, got {max_tokens}")
    body["max_tokens"] = max_tokens
    _thinking(request.get("thinking"), body, max_tokens)
    stops = request.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list)
                              or not all(isinstance(s, str) and s for s in stops)):
        fail("stop_sequences", "must be a list of non-empty strings")
    if stops and len(stops) > MAX_STOP:
        fail("stop_sequences", f"may hold at most {MAX_STOP} entries, got {len(stops)}")
    if stops and max(map(len, stops)) > MAX_STOP_CHARS:
        fail("stop_sequences", f"each may be at most {MAX_STOP_CHARS} characters long")
    if stops:
        body["stop"] = list(stops)
    for name in ("temperature", "top_p", "top_k"):
        if request.get(name) is not None:
            body[name] = request[name]
    if field(request, "stream", bool, False):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body, list(stops or [])
