"""Chat requests -> what the chat template sees: messages as plain data, tools, tool calls
with parsed arguments, and the server's own template."""

from __future__ import annotations

from pathlib import Path

import orjson

from pyserve.server.errors import APIError


def load_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def template_messages(body: dict) -> list[dict]:
    """The conversation as plain data for the template: text parts joined with newlines (as
    vLLM joins them), tool calls and tool results passed through. Any role is the template's
    to read, as vLLM's custom message type lets it be (OpenAI's six roles are not the only
    ones templates know: "ipython", "observation", ...)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    cleaned = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise APIError(400, f"messages[{i}] needs a role (a non-empty string)", "messages")
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

def tool_mode(body: dict, generating: bool, auto_enabled: bool) -> tuple[str, list | None]:
    """(mode, the tools the template sees), vLLM's rules: with tools, tool_choice defaults to
    "auto", which needs --enable-auto-tool-choice (and its --tool-call-parser); "required" and
    a named function are enforced by a grammar and need neither; "none" shows the tools to the
    template and takes text. /tokenize (generating False) renders the tools whatever
    tool_choice says, as vLLM's does."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", "tools")
    if not generating:
        return "none", tools or None
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        return "none", None
    if choice is None or choice == "auto":
        if not auto_enabled:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", "tool_choice")
        return "auto", tools
    if choice in ("none", "required"):
        return choice, tools
    if isinstance(choice, dict):
        return "named", tools
    raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


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
