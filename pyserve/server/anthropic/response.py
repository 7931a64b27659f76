"""A chat completion (or its chunks) -> Anthropic's message (or its stream of events).

    id chatcmpl-X                 msg_X;  a tool call's call_Y -> toolu_Y
    message.reasoning             a thinking block first (thinking asked for, with
                                  --reasoning-parser), its signature THINKING_SIGNATURE; with
                                  thinking.display "omitted" its text is empty (Anthropic's
                                  reading: the block and signature stay, the text does not)
    message.content               a text block (when not empty)
    message.tool_calls            tool_use blocks, `input` parsed from the arguments
    finish_reason stop            end_turn; stop_sequence (with the sequence) when the choice's
                                  stop_reason is one of the request's stop_sequences; tool_use
                                  when tools were called (a forced tool keeps "stop" on chat)
    finish_reason length          max_tokens
    finish_reason tool_calls      tool_use
    finish_reason abort           an overloaded_error (the server ended the request)
    usage prompt/completion       input_tokens / output_tokens (cached prompt tokens, with
                                  --enable-prompt-tokens-details: cache_read_input_tokens)

A stream is message_start (sent before generation begins, with a ping; more pings until
the first token; its input_tokens is the whole prompt, which message_delta's usage splits into
input_tokens and cache_read_input_tokens where the cached count is reported), then per content
block content_block_start, its deltas (thinking_delta
then one signature_delta, text_delta, or input_json_delta carrying the tool call's argument
pieces) and content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop. An engine failure ends it
with an error event."""

from __future__ import annotations

import json

from pyserve.server.anthropic.request import THINKING_SIGNATURE
from pyserve.server.errors import APIError, anthropic_error_type

_ABORTED = "the request was ended by the server before it finished (it is shutting down)"


def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as an object; {} when they are not one (cut short by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, matched, stop_sequences: list[str],
                tools_called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat choice's finish_reason and stop_reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "abort":
        raise APIError(503, _ABORTED)
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    if tools_called or finish == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def usage(chat_usage: dict | None) -> dict:
    """Anthropic's usage; with --enable-prompt-tokens-details the prompt tokens the prefix
    cache served are cache_read_input_tokens, and input_tokens the rest (Anthropic's split)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    out = {"input_tokens": prompt - (cached or 0), "output_tokens": chat_usage.get("completion_tokens", 0)}
    if cached is not None:
        out["cache_creation_input_tokens"], out["cache_read_input_tokens"] = 0, cached
    return out


def message(chat: dict, stop_sequences: list[str], thinking_omitted: bool = False) -> dict:
    """A whole chat completion -> an Anthropic message."""
    choice = chat["choices"][0]
    answer = choice["message"]
    content: list[dict] = []
    if answer.get("reasoning"):
        content.append({"type": "thinking", "thinking": "" if thinking_omitted else answer["reasoning"],
                        "signature": THINKING_SIGNATURE})
    if answer.get("content"):
        content.append({"type": "text", "text": answer["content"]})
    calls = answer.get("tool_calls") or []
    for call in calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                        "name": call["function"]["name"],
                        "input": tool_input(call["function"]["arguments"])})
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                   stop_sequences, bool(calls))
    return {"id": message_id(chat["id"]), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(chat.get("usage"))}


def error_event(status: int, message: str) -> tuple[str, dict]:
    return "error", {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


class MessageEvents:
    """Chat chunk dicts in, Anthropic stream events out, as (event type, data) pairs: feed()
    each chunk, then close() once the chunks end. `failed` turns true when an error event was
    given (nothing more may follow it)."""

    def __init__(self, stop_sequences: list[str], thinking_omitted: bool = False):
        self.stop_sequences = stop_sequences
        self.thinking_omitted = thinking_omitted  # thinking blocks without their text
        self.started = False
        self.failed = False
        self.open: tuple[str, int] | None = None  # the open block: (kind, index)
        self.blocks = 0  # blocks started
        self.tool_blocks: dict[int, int] = {}  # a chat tool call's index -> its block's index
        self.finish = self.matched = None
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def feed(self, chunk: dict) -> list[tuple[str, dict]]:
        if "error" in chunk:
            error = chunk["error"]
            self.failed = True
            return [error_event(error.get("code") or 500, error.get("message") or "generation failed")]
        events: list[tuple[str, dict]] = []
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        if not self.started:
            events += self.start(chunk["id"], chunk["model"], self.usage["input_tokens"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                if self.open is None or self.open[0] != "thinking":
                    events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                if not self.thinking_omitted:
                    events.append(self._delta(self.open[1], {"type": "thinking_delta",
                                                             "thinking": delta["reasoning"]}))
            if delta.get("content"):
                if self.open is None or self.open[0] != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append(self._delta(self.open[1], {"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                if call.get("id") is not None or call["index"] not in self.tool_blocks:
                    name = (call.get("function") or {}).get("name") or ""
                    events += self._start({"type": "tool_use", "id": tool_use_id(call.get("id") or ""),
                                           "name": name, "input": {}})
                    self.tool_blocks[call["index"]] = self.open[1]
                pieces = (call.get("function") or {}).get("arguments")
                if pieces:
                    events.append(self._delta(self.tool_blocks[call["index"]],
                                              {"type": "input_json_delta", "partial_json": pieces}))
            if choice.get("finish_reason") is not None:
                self.finish, self.matched = choice["finish_reason"], choice.get("stop_reason")
        return events

    def start(self, chat_id: str, model: str, input_tokens: int) -> list[tuple[str, dict]]:
        """message_start (given before the first chunk, or by it)."""
        self.started = True
        return [("message_start", {"type": "message_start", "message": {
            "id": message_id(chat_id), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})]

    def close(self) -> list[tuple[str, dict]]:
        """The events after the last chunk: the open block's stop, message_delta, message_stop."""
        try:
            reason, sequence = stop_reason(self.finish, self.matched, self.stop_sequences,
                                           bool(self.tool_blocks))
        except APIError as exc:
            self.failed = True
            return [error_event(exc.status, exc.message)]
        events = self._stop()
        events.append(("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                         "usage": dict(self.usage)}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self._stop()
        self.open = (block["type"], self.blocks)
        self.blocks += 1
        events.append(("content_block_start", {"type": "content_block_start", "index": self.open[1],
                                               "content_block": block}))
        return events

    def _stop(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        (kind, index), self.open = self.open, None
        events = []
        if kind == "thinking":  # a thinking block ends with its signature
            events.append(self._delta(index, {"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    @staticmethod
    def _delta(index: int, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
