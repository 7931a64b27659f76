"""Chat requests -> what the chat template sees: messages as plain data, tools, tool calls
with parsed arguments, and the server's own template."""

from __future__ import annotations

from pathlib import Path

import orjson

from pyserve.server.errors import APIError
from pyserve.server.request_limits import (MAX_CONTENT_PARTS, MAX_DOCUMENTS, MAX_MESSAGES,
                                          MAX_TOOL_CALLS, MAX_TOOLS)
from pyserve.server.values import brief, capped, check_nesting, field

# apply_chat_template's own arguments and what the server passes it: chat_template_kwargs may
# not set them (a 400 naming the key; vLLM drops some silently, which hides a client's mistake)
RESERVED_TEMPLATE_KWARGS = frozenset((
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer",
    "tokenizer_kwargs", "add_special_tokens", "sanitize_control_tokens"))


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
    capped("messages", messages, MAX_MESSAGES, "messages")
    calls = sum(len(m["tool_calls"]) for m in messages
                if isinstance(m, dict) and isinstance(m.get("tool_calls"), list))
    if calls > MAX_TOOL_CALLS:  # before any call's arguments are parsed
        raise APIError(400, f"messages may hold at most {MAX_TOOL_CALLS} tool calls in all, got "
                       f"{calls}", "messages")
    parts = 0
    cleaned = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise APIError(400, f"messages[{i}] needs a role (a non-empty string)", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts += len(content)
            if parts > MAX_CONTENT_PARTS:
                raise APIError(400, f"messages may hold at most {MAX_CONTENT_PARTS} content parts "
                               "in all", "messages")
            content = "\n".join(_part_text(p, i, j) for j, p in enumerate(content))
        if content is None:
            content = ""  # e.g. an assistant turn that only calls tools (vLLM: no parts)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}]: content must be a string or a list of text parts",
                           "messages")
        message = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                message[key] = m[key]
        # an assistant turn's reasoning, for templates that render it: under both names, as
        # vLLM hands it on (templates read message.reasoning_content or message.reasoning)
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise APIError(400, f"messages[{i}]: reasoning_content must be a string", "messages")
            message["reasoning_content"] = message["reasoning"] = reasoning
        if m.get("tool_calls"):
            message["tool_calls"] = template_tool_calls(m["tool_calls"])
        if m.get("function_call") is not None:  # the legacy form: not to be dropped unread
            raise APIError(400, f"messages[{i}].function_call: the legacy function-call form is not "
                           "supported; send tool_calls", "messages")
        cleaned.append(message)
    return cleaned


def without_oldest_turns(messages: list[dict]) -> list[list[dict]]:
    """The conversation cut at each exchange boundary, shortest last: the leading system
    messages stay, and each cut drops everything after them up to a later user message (whole
    exchanges: a user turn with the answer, tool calls and tool results after it, so no tool
    result loses its call). The last exchange is never cut."""
    start = 0
    while start < len(messages) and messages[start]["role"] == "system":
        start += 1
    return [messages[:start] + messages[i:] for i in range(start + 1, len(messages))
            if messages[i]["role"] == "user"]


def fit_by_dropping_turns(messages: list[dict], render, fits) -> list[int]:
    """The rendered ids of the conversation with the fewest oldest exchanges dropped for
    fits(ids) to hold (the Responses API's truncation "auto"): a binary search over the
    boundaries (without_oldest_turns), a handful of renders however long the conversation;
    the shortest cut's ids when even that does not fit (the caller's 400)."""
    ids = render(messages)
    if fits(ids):
        return ids
    cuts = without_oldest_turns(messages)
    low, high, best = 0, len(cuts) - 1, None
    while low <= high:  # fewer messages never render longer: fits() is monotonic in the cut
        middle = (low + high) // 2
        candidate = render(cuts[middle])
        if fits(candidate):
            best, high = candidate, middle - 1
        else:
            low = middle + 1
    if best is not None:
        return best
    return render(cuts[-1]) if cuts else ids


# the text of a content part, by its type (as vLLM reads them): text, and the Responses API's
# input_text / output_text parts a bridge may pass on, and an assistant's refusal
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _part_text(part, i: int, j: int) -> str:
    if isinstance(part, str):  # a bare string in the list, as vLLM takes it
        return part
    kind = part.get("type") if isinstance(part, dict) else None
    key = _TEXT_KEYS.get(kind)
    if key is None or not isinstance(part.get(key), str):
        raise APIError(400, f"messages[{i}].content[{j}]: only text content parts "
                       "({\"type\": \"text\", \"text\": ...}) are supported; got "
                       + (f"type {brief(kind)}" if kind is not None else brief(part)), "messages")
    return part[key]


# OpenAI's reasoning_effort values; vLLM's chat request takes the field
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def template_kwargs(body: dict) -> dict:
    """The request's chat_template_kwargs (a copy), none of them a reserved name, and its
    reasoning_effort as the template variable of that name (the one chat templates that take
    an effort read, gpt-oss's among them; chat_template_kwargs' own value wins)."""
    kwargs = field(body, "chat_template_kwargs", dict, {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the "
                       "request's own fields and the server set these", "chat_template_kwargs")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                           f"got {brief(effort)}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def template_documents(body: dict) -> list | None:
    """vLLM's documents (a list of objects, e.g. {"title", "text"}) for RAG templates."""
    documents = body.get("documents")
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
        raise APIError(400, "'documents' must be a list of objects", "documents")
    capped("documents", documents, MAX_DOCUMENTS, "documents")
    return documents


def tool_function(tool, i: int) -> dict:
    """tools[i]'s function, checked as vLLM's request model checks it, whatever tool_choice
    says: {"type": "function", "function": {"name": str, ...}}."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function" \
            or not isinstance(function.get("name"), str):
        raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                       "{\"name\": ..., \"parameters\": ...}}", "tools")
    return function


def with_allowed_tools(body: dict) -> dict:
    """tool_choice {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}} -> the body
    with only the tools it names and its mode as the tool_choice: the model is shown and may
    call only those ("required" held to them by its grammar, as a plain "required")."""
    choice = body.get("tool_choice")
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return body
    spec = choice.get("allowed_tools")
    if set(choice) - {"type", "allowed_tools"} or not isinstance(spec, dict) \
            or set(spec) - {"mode", "tools"} or spec.get("mode") not in ("auto", "required") \
            or not isinstance(spec.get("tools"), list):
        raise APIError(400, 'tool_choice allowed_tools must be {"type": "allowed_tools", '
                       '"allowed_tools": {"mode": "auto" | "required", "tools": [{"type": '
                       '"function", "function": {"name": ...}}, ...]}}', "tool_choice")
    names = set()
    for entry in spec["tools"]:
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or entry.get("type") != "function" \
                or not isinstance(function.get("name"), str):
            raise APIError(400, "tool_choice allowed_tools: only function tools can be allowed",
                           "tool_choice")
        names.add(function["name"])
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    kept = [t for i, t in enumerate(tools) if tool_function(t, i)["name"] in names]
    missing = names - {tool_function(t, i)["name"] for i, t in enumerate(kept)}
    if missing:
        raise APIError(400, f"tool_choice allowed_tools names tools not in tools: "
                       f"{', '.join(sorted(missing))}", "tool_choice")
    return {**body, "tools": kept, "tool_choice": spec["mode"]}


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
    if tools == [] and generating:  # vLLM's check and words
        raise APIError(400, "`tools` must not be an empty array", "tools")
    if tools:
        capped("tools", tools, MAX_TOOLS, "tools")
        for i, tool in enumerate(tools):  # in every mode: "auto" and "none" render them too
            tool_function(tool, i)
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
    if len(calls) > MAX_TOOLS:
        raise APIError(400, f"a message may hold at most {MAX_TOOLS} tool calls", "messages")
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
            # the template renders arguments recursively: as deep as a body may nest, no deeper
            check_nesting(function["arguments"], arguments, "a tool call's arguments", "messages")
            call = {**call, "function": {**function,
                                         "arguments": arguments if isinstance(arguments, dict) else {}}}
        out.append(call)
    return out
