"""An Anthropic request's system and messages -> chat messages (request.py's table says how
each block and role is read): text blocks as text parts, tool_use / tool_result as tool calls
and tool messages, thinking history as reasoning_content, Claude Code's roles and reminders,
consecutive turns of one role joined. Errors are APIError(400, message, param) with
Anthropic's field names."""

from __future__ import annotations

import json

from pyserve.server.errors import APIError
from pyserve.server.request_limits import MAX_CONTENT_PARTS
from pyserve.server.values import brief, field

# Claude Code (2.1.154 and later) also sends context as roles ctx and msg: user turns
_ROLES = {"user": "user", "assistant": "assistant", "ctx": "user", "msg": "user"}
# Claude Code's first system line, different on every request (cch=...): it means nothing to a
# model, and left in it would make every prompt's first tokens new to the prefix cache
BILLING_HEADER = "x-anthropic-billing-header:"
_TEXT_ONLY = "this server's model takes text only"
# a joined assistant turn's reasoning texts, kept apart until the end (_join_reasoning): not a
# name any JSON message can hold
_REASONING_PIECES = " reasoning pieces"


def fail(param: str, message: str):
    raise APIError(400, f"{param}: {message}", param.split(".")[0].split("[")[0])


def check_keys(block: dict, where: str, allowed: set[str]) -> None:
    """A block's keys beyond `allowed` must be ones that change nothing: cache_control (prefix
    caching here is automatic), a direct caller on tool_use, or null."""
    for key, value in block.items():
        if key in allowed or key == "cache_control" or value is None:
            continue
        if key == "caller" and value == {"type": "direct"}:
            continue
        fail(f"{where}.{key}", "this field is not supported by this server")


def _text_parts(blocks, where: str) -> list[dict]:
    """A string or a list of text blocks -> OpenAI text parts."""
    if isinstance(blocks, str):
        return [{"type": "text", "text": blocks}]
    if not isinstance(blocks, list):
        fail(where, "must be a string or a list of text blocks")
    return [_text_part(block, f"{where}[{j}]") for j, block in enumerate(blocks)]


def _text_part(block, where: str) -> dict:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("image", "document"):
            fail(where, f"{kind} blocks are not supported: {_TEXT_ONLY}")
        fail(where, "must be a text block ({\"type\": \"text\", \"text\": ...})")
    if not isinstance(block.get("text"), str):
        fail(f"{where}.text", "a text block requires 'text' (a string)")
    check_keys(block, where, {"type", "text", "citations"})  # citations: where text came from
    return {"type": "text", "text": block["text"]}


def _tool_call(block: dict, where: str) -> dict:
    check_keys(block, where, {"type", "id", "name", "input"})
    # as Anthropic (and vLLM, in its words) validate a past call: a result must be able to
    # name it, and "input" is what it was called with ({} for none), not something to guess
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            fail(f"{where}.{key}", f"a tool_use block requires a non-empty '{key}' (a string)")
    arguments = block.get("input")
    if arguments is None:
        fail(f"{where}.input", "a tool_use block requires 'input' (an object; {} for none)")
    if not isinstance(arguments, dict):
        fail(f"{where}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_message(block: dict, where: str) -> dict:
    check_keys(block, where, {"type", "tool_use_id", "content", "is_error"})
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        fail(f"{where}.tool_use_id", "a tool_result block requires a non-empty 'tool_use_id' "
             "(the id of the tool_use it answers)")
    content = block.get("content")
    text = "" if content is None else "\n".join(
        p["text"] for p in _text_parts(content, f"{where}.content"))
    # a chat template has no place for is_error: the model reads it in the result's text
    if field(block, "is_error", bool, False):
        text = "Error: " + text if text else "Error"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _thinking_text(block: dict, where: str) -> str:
    check_keys(block, where, {"type", "thinking", "signature"})
    if not isinstance(block.get("thinking"), str):
        fail(f"{where}.thinking", "a thinking block requires 'thinking' (a string)")
    return block["thinking"]


def _turn(i: int, message, calls_before: set[str]) -> list[dict]:
    """One Anthropic message -> its chat messages (a user's tool results split it, each
    answering a tool_use of calls_before's: the assistant turn before it)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        fail(where, "must be an object with role \"user\", \"assistant\" or \"system\"")
    check_keys(message, where, {"role", "content"})
    role, content = _ROLES[message["role"]], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list) or not content:
        fail(f"{where}.content", "must be a string or a non-empty list of content blocks")
    out: list[dict] = []
    parts: list[dict] = []
    calls: list[dict] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(_text_part(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            result = _tool_message(block, at)
            if result["tool_call_id"] not in calls_before:  # Anthropic's 400 too
                fail(at, f"tool_result answers tool_use_id {brief(result['tool_call_id'])}, but the "
                      "assistant message before it holds no tool_use block of that id: each "
                      "tool_result must answer a tool_use of the previous message")
            out.append(result)
        elif kind in ("image", "document"):
            fail(at, f"{kind} blocks are not supported: {_TEXT_ONLY}")
        elif kind == "thinking" and role == "assistant":
            reasoning.append(_thinking_text(block, at))
        elif kind == "redacted_thinking" and role == "assistant":
            check_keys(block, at, {"type", "data"})  # opaque: nothing a template can render
            if not isinstance(block.get("data"), str) or not block["data"]:
                fail(f"{at}.data", "a redacted_thinking block requires a non-empty 'data' (the "
                     "string the API returned)")
        elif kind in ("tool_use", "tool_result", "thinking", "redacted_thinking"):
            owner = "a user" if kind == "tool_result" else "an assistant"
            fail(at, f"{kind} blocks belong in {owner} message")
        else:
            fail(at, f"content blocks of type {brief(kind)} are not supported by this server")
    if role == "assistant":
        message = {"role": "assistant", "content": parts or None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "\n".join(reasoning)
        out.append(message)
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


def _check_block_count(system, messages: list) -> None:
    """At most MAX_CONTENT_PARTS content blocks in all (system's included), counted before
    any is read: reading 900,000 of them took seconds."""
    lists = [system] + [m.get("content") for m in messages if isinstance(m, dict)]
    blocks = sum(len(content) for content in lists if isinstance(content, list))
    if blocks > MAX_CONTENT_PARTS:
        fail("messages", f"may hold at most {MAX_CONTENT_PARTS} content blocks in all (system's "
             f"included), got {blocks}")


def _parts(content) -> list[dict]:
    """A chat message's content as text parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return content or []


def _extend(chat: list[dict], turn: list[dict]) -> None:
    """Appends a turn's chat messages; one that follows a message of its own role (user or
    assistant) joins it, as Anthropic combines consecutive turns of one role."""
    role = turn[0]["role"]
    if chat and chat[-1]["role"] == role and role in ("user", "assistant"):
        # in place, in proportion to the turn joined (a list rebuilt on every turn made
        # thousands of consecutive turns quadratic): the lists are this module's own
        last, first = chat[-1], turn.pop(0)
        last["content"] = _parts(last["content"])
        last["content"] += _parts(first["content"])
        if first.get("tool_calls"):
            last.setdefault("tool_calls", []).extend(first["tool_calls"])
        if first.get("reasoning_content"):
            earlier = last.get("reasoning_content")
            last.setdefault(_REASONING_PIECES, [earlier] if earlier else []).append(
                first["reasoning_content"])
    chat += turn


def _join_reasoning(chat: list[dict]) -> None:
    """The reasoning of joined assistant turns, joined once (_extend gathers it)."""
    for message in chat:
        pieces = message.pop(_REASONING_PIECES, None)
        if pieces is not None:
            message["reasoning_content"] = "\n".join(pieces)


def _system_parts(content, where: str) -> list[dict]:
    """System text as text parts, Claude Code's billing line left out."""
    parts = []
    for part in _text_parts(content, where):
        text = part["text"]
        if text.startswith(BILLING_HEADER):
            text = text.partition("\n")[2]  # a string system: the line, not the rest
            if not text:
                continue
        parts.append({"type": "text", "text": text})
    return parts


def _remind(chat: list[dict], parts: list[dict]) -> None:
    """A system message met mid-conversation: its text as user text where it stands (joined
    to a user message that ends the chat so far, else a user message of its own)."""
    if chat and chat[-1]["role"] == "user":
        chat[-1]["content"] = _parts(chat[-1]["content"])
        chat[-1]["content"] += parts
    else:
        chat.append({"role": "user", "content": parts})


def conversation(system, messages: list) -> list[dict]:
    """The chat messages of a request's system and messages."""
    _check_block_count(system, messages)
    leading = [] if system is None or system == "" or system == [] else _system_parts(system, "system")
    chat: list[dict] = []
    # the tool_use ids of the assistant turn before (consecutive assistant messages are one
    # turn, as are consecutive user messages): what a tool_result may answer
    calls: set[str] = set()
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "system":
            check_keys(message, f"messages[{i}]", {"role", "content"})
            parts = _system_parts(message.get("content"), f"messages[{i}].content")
            if not chat:
                leading += parts
            elif parts:
                _remind(chat, parts)
            continue
        turn = _turn(i, message, calls)
        if turn[0]["role"] == "assistant":
            ids = {call["id"] for call in turn[0].get("tool_calls", ())}
            if chat and chat[-1]["role"] == "assistant":
                calls |= ids  # in place: a new set per turn is quadratic over many turns
            else:
                calls = ids
        _extend(chat, turn)
    if not chat:
        fail("messages", "must hold a user or assistant message")
    _join_reasoning(chat)
    return ([{"role": "system", "content": leading}] if leading else []) + chat
