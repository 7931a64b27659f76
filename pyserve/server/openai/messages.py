"""Chat requests -> what the chat template sees: messages as plain data, tools, tool calls
with parsed arguments, and the server's own template."""

from __future__ import annotations

from pathlib import Path

import orjson

from pyserve.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def load_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def template_messages(body: dict) -> list[dict]:
    """The conversation as plain data for the template: text parts joined with newlines (as
    vLLM joins them), tool calls and tool results passed through."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    cleaned = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] needs a role, one of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}]: only text content parts "
                               "({\"type\": \"text\", \"text\": ...}) are supported", "messages")
            content = "\n".join(p["text"] for p in content)
        if content is None:
            content = ""  # e.g. an assistant turn that only calls tools (vLLM: no parts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}]: content must be a string or a list of text parts",
                           "messages")
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        if m.get("tool_calls"):
            message["tool_calls"] = template_tool_calls(m["tool_calls"])
        cleaned.append(message)
    return cleaned

def template_tools(body: dict, generating: bool) -> list | None:
    """vLLM's rules without a tool-call parser: tools reach the template only with
    tool_choice "none"; "auto" (the default when tools are given), "required" and a named
    tool need a parser or guided decoding, which pyserve does not have. /tokenize
    (generating False) renders the tools whatever tool_choice says, as vLLM's does."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", "tools")
    if not generating:
        return tools or None
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    if choice is None or choice == "auto":
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                       "--tool-call-parser to be set, which this server does not support; "
                       'send tool_choice "none" to show the tools to the model', "tool_choice")
    if choice != "none":
        raise APIError(400, "tool_choice \"required\" or a named tool needs guided decoding, "
                       "which this server does not support", "tool_choice")
    return tools


def template_tool_calls(calls) -> list:
    """Tool calls as chat templates expect them (transformers' convention, which vLLM
    follows): each function's `arguments` a dict, parsed from OpenAI's JSON string ({} if it
    is not a JSON object)."""
    if not isinstance(calls, list):
        raise APIError(400, "'tool_calls' must be a list", "messages")
    out = []
    for call in calls:
        if not isinstance(call, dict):
            raise APIError(400, "each tool call must be an object", "messages")
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = orjson.loads(function["arguments"])
            except orjson.JSONDecodeError:
                arguments = {}
            call = {**call, "function": {**function,
                                         "arguments": arguments if isinstance(arguments, dict) else {}}}
        out.append(call)
    return out
