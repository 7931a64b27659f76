"""Responses input items <-> chat messages: a request's input (or a stored response's output,
which has the same item shapes) read as the conversation the chat path renders, and a
response's output added to its conversation for later turns (previous_response_id).

    message                 its role (developer is the chat path's system), input_text /
                            output_text parts joined with newlines (a refusal part's text too)
    function_call           an assistant turn's tool_calls (consecutive calls, and a text turn
                            just before them, are one assistant message)
    function_call_output    a tool message
    reasoning               the next assistant turn's reasoning_content (encrypted_content: a
                            400); with no answer after it, a turn of its own (vLLM's reading)"""

from __future__ import annotations

from pyserve.server.errors import APIError
from pyserve.server.request_limits import MAX_CONTENT_PARTS, MAX_MESSAGES
from pyserve.server.values import brief

TEXT_PARTS = ("input_text", "output_text")
INPUT_ROLES = ("user", "system", "developer", "assistant")
# a namespace tool's function is named namespace + this + name on the chat path (vLLM's)
NAMESPACE_SEPARATOR = "__"


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):  # an answer's refusal
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS:
            raise APIError(400, f"{where}: content part type {brief(kind)} is not supported; only "
                           "input_text and output_text parts are", "input")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: an {kind} part needs a text string", "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}: {key} must be a string", "input")
    return value


def input_messages(items, where: str = "input") -> list[dict]:
    """A request's input (or a response's output, which has the same item shapes) as chat
    messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, f"{where} must be a string or a non-empty list of items", "input")
    if len(items) > MAX_MESSAGES:  # before any is translated
        raise APIError(400, f"{where} may hold at most {MAX_MESSAGES} items, got {len(items)}", "input")
    _check_part_count(items, where)
    messages: list[dict] = []
    # reasoning turns of several items: their texts, joined once at the end (a += per item
    # is quadratic over thousands of items)
    thoughts: list[tuple[dict, list[str]]] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{at} must be an object", "input")
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        # reasoning opens an assistant turn (vLLM's reading) that the answer after it, text or
        # calls, completes; with none after it, it stays a turn of its own
        thought = last is not None and _reasoning_only(last)
        if kind == "reasoning":
            text = _reasoning_text(item, at)
            if thought:  # the last turn of thoughts' is last (nothing else makes such a turn)
                thoughts[-1][1].append(text)
            else:
                messages.append({"role": "assistant", "content": None, "reasoning_content": text})
                thoughts.append((messages[-1], [text]))
        elif kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise APIError(400, f"{at}: role must be one of {', '.join(INPUT_ROLES)}", "input")
            if role == "assistant" and thought:
                last["content"] = _text(item.get("content"), at)
            else:
                messages.append({"role": role, "content": _text(item.get("content"), at)})
        elif kind == "function_call":
            name = _string(item, "name", at)
            if item.get("namespace") is not None:  # a namespace tool's: its flat chat name
                name = _string(item, "namespace", at) + NAMESPACE_SEPARATOR + name
            call = {"id": _string(item, "call_id", at), "type": "function",
                    "function": {"name": name, "arguments": _string(item, "arguments", at)}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at),
                             "content": _text(item.get("output"), at)})
        else:
            raise APIError(400, f"{at}: input item type {brief(kind)} is not supported; only message, "
                           "reasoning, function_call and function_call_output items are", "input")
    for message, texts in thoughts:
        if len(texts) > 1:
            message["reasoning_content"] = "\n".join(texts)
    if all(_reasoning_only(m) for m in messages):
        raise APIError(400, f"{where} holds no message: reasoning items alone are no conversation", "input")
    return messages


def _check_part_count(items: list, where: str) -> None:
    """At most MAX_CONTENT_PARTS parts over all items (a message's content, a reasoning
    item's content and summary, a tool output's), counted before any is read."""
    parts = 0
    for item in items:
        if isinstance(item, dict):
            for key in ("content", "summary", "output"):
                if isinstance(item.get(key), list):
                    parts += len(item[key])
    if parts > MAX_CONTENT_PARTS:
        raise APIError(400, f"{where} may hold at most {MAX_CONTENT_PARTS} content parts in all, "
                       f"got {parts}", "input")


def _reasoning_only(message: dict) -> bool:
    """An assistant turn of reasoning that no answer has completed yet."""
    return (message["role"] == "assistant" and message.get("reasoning_content") is not None
            and message.get("content") is None and not message.get("tool_calls"))


def _reasoning_text(item: dict, at: str) -> str:
    """A reasoning item's text (its reasoning_text parts, else its summary's): what a
    template that renders past reasoning shows. Encrypted reasoning is another server's."""
    if item.get("encrypted_content") is not None:
        raise APIError(400, f"{at}: encrypted_content cannot be read by this server", "input")
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise APIError(400, f"{at}: {key} must be a list of parts", "input")
        for part in parts:
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                raise APIError(400, f"{at}: {key} parts must be {kind} parts with a text", "input")
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)


def with_answer(conversation: list[dict], output: list[dict], continued: bool) -> list[dict]:
    """The conversation with a response's output items as its next turn(s); a continued
    message (continues_last_message) takes the answer's text as the rest of its own, so a
    later turn renders one assistant message, as the model wrote it."""
    answer = input_messages(output, "output")
    last, first = (conversation[-1] if conversation else None), answer[0]
    if not (continued and last is not None and last["role"] == "assistant" and first["role"] == "assistant"
            and isinstance(last.get("content"), str) and isinstance(first.get("content"), str)):
        return conversation + answer
    joined = {**first, **last, "content": last["content"] + first["content"]}
    reasoning = "\n".join(filter(None, (last.get("reasoning_content"), first.get("reasoning_content"))))
    if reasoning:
        joined["reasoning_content"] = reasoning
    if first.get("tool_calls"):
        joined["tool_calls"] = first["tool_calls"]
    return conversation[:-1] + [joined] + answer[1:]


def continues_last_message(items) -> bool:
    """The input ends with an assistant message left unfinished (incomplete, or still
    in_progress, as vLLM reads it): the answer continues it."""
    last = items[-1] if isinstance(items, list) and items else None
    return (isinstance(last, dict) and last.get("type", "message") == "message"
            and last.get("role") == "assistant" and last.get("status") in ("incomplete", "in_progress"))


def current_turn_reasoning(conversation: list[dict]) -> list[dict]:
    """The conversation without the reasoning of assistant turns before its last user turn."""
    last_user = max((i for i, m in enumerate(conversation) if m.get("role") == "user"), default=-1)
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if i < last_user else m
            for i, m in enumerate(conversation)]
