"""The chat path's answer -> a Responses response object, whole or as its stream of events.

A chat message becomes output items: its reasoning (with --reasoning-parser) a reasoning item
first (one reasoning_text part; when reasoning.summary asks for a summary, the same text as its
one summary_text part too: there is no summarizer, and the whole reasoning is the most detailed
summary of itself), its content a message item (one output_text
part), each tool call a function_call item (call_id the chat call's id). finish_reason "length" makes the
response "incomplete" (reason max_output_tokens) and its last item too (every item, when it
was cut while reasoning). Streams follow
OpenAI's order: response.created, response.in_progress, then per item output_item.added,
(content_part.added, output_text.delta..., output_text.done, content_part.done), or for
reasoning (content_part.added, reasoning_text.delta..., reasoning_text.done,
content_part.done; with a summary, reasoning_summary_part.added after content_part.added, a
reasoning_summary_text.delta after each reasoning_text.delta, reasoning_summary_text.done and
reasoning_summary_part.done last), or
(function_call_arguments.delta..., function_call_arguments.done), output_item.done, and last
response.completed with the whole response, whose status may be "incomplete" (vLLM's
terminal event; OpenAI sends response.incomplete then, which the openai SDK's stream helper
cannot finish on: `responses.stream(...).get_final_response()` raises without a
response.completed), or response.failed if the engine fails. Each event carries its type and a
sequence_number from 0."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pyserve.server.openai.params import field
from pyserve.server.openai.responses.items import continues_last_message
from pyserve.server.openai.responses.translate import namespaced_names
from pyserve.server.strict_json import json_bytes


# the statuses of a response that has not ended (a background one's, or a stream's events')
UNFINISHED = ("queued", "in_progress")
# the events that end a stream, each with the final response
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def sse(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json_bytes(event) + b"\n\n"


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg_"), "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None,
                   summarized: bool = False) -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs_"), "status": status,
            "summary": [summary_part(text)] if summarized else [], "content": [reasoning_part(text)]}


def summary_part(text: str) -> dict:
    return {"type": "summary_text", "text": text}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def chat_logprobs(choice: dict) -> list[dict]:
    """A chat choice's (or chunk choice's) token logprobs as Responses' output_text logprobs:
    the same {token, logprob, bytes, top_logprobs} entries (the chat path fills them only when
    the request included message.output_text.logprobs), [] without them."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def call_item(call_id: str, name: str, arguments: str, status: str = "completed",
              item_id: str | None = None, namespaces: dict | None = None) -> dict:
    """namespaces: the request's flat namespace-tool names -> (namespace, name)."""
    item = {"type": "function_call", "id": item_id or _id("fc_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if namespaces and name in namespaces:
        item["namespace"], item["name"] = namespaces[name]
    return item


def usage(chat_usage: dict | None) -> dict:
    chat_usage = chat_usage or {}
    prompt, completion = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                             "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


UNREAD = object()  # Turn.events' first: no chunk read yet


def _reasoning_echo(reasoning) -> dict | None:
    """The request's reasoning settings as the response echoes them (effort applied as the
    chat template's reasoning_effort; summary, or its older name generate_summary)."""
    if not isinstance(reasoning, dict):
        return None
    echo = {"effort": reasoning.get("effort"),
            "summary": reasoning.get("summary") or reasoning.get("generate_summary")}
    echo.update({key: reasoning[key] for key in ("context", "mode") if reasoning.get(key) is not None})
    return echo


class Turn:
    """One Responses request: its id and the request fields every response object echoes."""

    def __init__(self, body: dict, defaults: dict, model: str):
        self.id = _id("resp_")
        self.created_at = int(time.time())
        # the answer continues the input's last (incomplete) assistant message
        self.continues = continues_last_message(body.get("input"))
        echo = _reasoning_echo(body.get("reasoning"))
        self.summarized = echo is not None and echo["summary"] is not None
        self.namespaces = namespaced_names(body.get("tools"))
        choice = body.get("tool_choice")
        text = dict(body.get("text") or {})
        if text.get("format") is None:  # OpenAI's echo names the plain format
            text["format"] = {"type": "text"}
        self.echo = {
            "model": model, "instructions": body.get("instructions"),
            "max_output_tokens": field(body, "max_output_tokens", int),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": field(body, "parallel_tool_calls", bool, True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": echo, "store": field(body, "store", bool, True),
            # the effective values: the request's, else the model's generation defaults
            "temperature": field(body, "temperature", float, defaults.get("temperature", 1.0)),
            "top_p": field(body, "top_p", float, defaults.get("top_p", 1.0)),
            "text": text,
            "tool_choice": choice if choice is not None else "auto",
            "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled",
            "user": body.get("user"), "safety_identifier": body.get("safety_identifier"),
            "prompt_cache_key": body.get("prompt_cache_key"),
            "service_tier": body.get("service_tier") or "auto",  # vLLM's echo (it has one tier)
            "background": field(body, "background", bool, False),
            "top_logprobs": field(body, "top_logprobs", int, 0),
            "max_tool_calls": field(body, "max_tool_calls", int)}

    def response(self, status: str, output: list[dict], chat_usage: dict | None = None,
                 error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "completed_at": int(time.time()) if status == "completed" else None,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                **self.echo, "output": output,
                "usage": usage(chat_usage) if status not in UNFINISHED + ("cancelled",) else None}

    def from_completion(self, completion: dict) -> dict:
        choice = completion["choices"][0]
        message = choice["message"]
        output = ([reasoning_item(message["reasoning"], summarized=self.summarized)]
                  if message.get("reasoning") else [])
        output += ([message_item(message["content"], logprobs=chat_logprobs(choice))]
                   if message.get("content") else [])
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                             namespaces=self.namespaces)
                   for c in message.get("tool_calls") or []]
        cut_in_reasoning = not any(item["type"] != "reasoning" for item in output)
        if cut_in_reasoning:
            output.append(message_item(""))  # an answer, if an empty one
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        if status == "incomplete":
            for item in output if cut_in_reasoning else output[-1:]:
                item["status"] = "incomplete"
        return self.response(status, output, completion.get("usage"))

    async def events(self, chunks: AsyncIterator[dict], first, done: list) -> AsyncIterator[dict]:
        """The stream's events from the chat chunks (first: the one already read, None if
        there were none, or UNREAD: read after the opening events, which then go out before
        the prefill); the final response is appended to done."""
        stream = _Events(self.summarized, self.namespaces)
        yield stream.event("response.created", response=self.response("in_progress", []))
        yield stream.event("response.in_progress", response=self.response("in_progress", []))
        chunk = await anext(chunks, None) if first is UNREAD else first
        while chunk is not None:
            if "error" in chunk:
                error = {"code": "server_error", "message": chunk["error"].get("message", "error")}
                for event in stream.close("error"):
                    yield event
                failed = self.response("failed", stream.items, stream.usage, error=error)
                yield stream.event("response.failed", response=failed)
                return
            for event in stream.feed(chunk):
                yield event
            chunk = await anext(chunks, None)
        for event in stream.close(stream.finish, last=True):
            yield event
        status = "incomplete" if stream.finish == "length" else "completed"
        final = self.response(status, stream.items, stream.usage)
        done.append(final)
        yield stream.event("response.completed", response=final)


class _Events:
    """The state of one stream: its items so far, the open one, the chat calls' items."""

    def __init__(self, summarized: bool, namespaces: dict):
        self.summarized = summarized  # reasoning items carry their text as a summary too
        self.namespaces = namespaces  # flat namespace-tool names -> (namespace, name)
        self.sequence = 0
        self.items: list[dict] = []
        self.open: int | None = None  # output index of the item still receiving deltas
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish: str | None = None
        self.usage: dict | None = None
        self.pending_logprobs: list[dict] = []  # tokens whose text has not come yet

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def feed(self, chunk: dict) -> list[dict]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[dict] = []
        for choice in chunk.get("choices") or []:
            self.finish = choice.get("finish_reason") or self.finish
            delta = choice.get("delta") or {}
            # tokens whose text the chat path held back (a stop string's prefix, part of a
            # character) wait for the delta that carries their text; the message takes what
            # is left when it closes (the end-of-turn token), as a whole answer holds them all
            self.pending_logprobs += chat_logprobs(choice)
            if delta.get("reasoning"):
                if self.open is None or self.items[self.open]["type"] != "reasoning":
                    events += self.close(None)
                    events += self._add(reasoning_item("", "in_progress", summarized=self.summarized))
                    events.append(self._at("response.content_part.added", part=reasoning_part("")))
                    if self.summarized:
                        events.append(self._summary("response.reasoning_summary_part.added",
                                                    part=summary_part("")))
                item = self.items[self.open]
                item["content"][0]["text"] += delta["reasoning"]
                events.append(self._at("response.reasoning_text.delta", delta=delta["reasoning"]))
                if self.summarized:
                    item["summary"][0]["text"] += delta["reasoning"]
                    events.append(self._summary("response.reasoning_summary_text.delta",
                                                delta=delta["reasoning"]))
                if not delta.get("content"):  # the reasoning's tokens are no answer's logprobs
                    self.pending_logprobs = []
            if delta.get("content"):
                if self.open is None or self.items[self.open]["type"] != "message":
                    events += self.close(None)
                    events += self._add(message_item("", "in_progress"))
                    events.append(self._at("response.content_part.added", part=text_part("")))
                item = self.items[self.open]
                logprobs, self.pending_logprobs = self.pending_logprobs, []
                item["content"][0]["text"] += delta["content"]
                item["content"][0]["logprobs"] += logprobs
                events.append(self._at("response.output_text.delta", delta=delta["content"],
                                       logprobs=logprobs))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call["index"] not in self.calls:
                    events += self.close(None)
                    events += self._add(call_item(call.get("id") or _id("call_"), function.get("name", ""),
                                                  "", "in_progress", namespaces=self.namespaces))
                    self.calls[call["index"]] = self.open
                index = self.calls[call["index"]]
                if function.get("arguments"):
                    self.items[index]["arguments"] += function["arguments"]
                    events.append(self.event("response.function_call_arguments.delta",
                                             item_id=self.items[index]["id"], output_index=index,
                                             delta=function["arguments"]))
        return events

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = len(self.items) - 1
        return [self.event("response.output_item.added", output_index=self.open,
                           item={**item, **{key: [] for key in ("content", "summary") if key in item}})]

    def _at(self, kind: str, **fields) -> dict:
        """An event of the open item's content part (a message's text, a reasoning's text)."""
        return self.event(kind, item_id=self.items[self.open]["id"], output_index=self.open,
                          content_index=0, **fields)

    def _summary(self, kind: str, **fields) -> dict:
        """An event of the open reasoning item's one summary part."""
        return self.event(kind, item_id=self.items[self.open]["id"], output_index=self.open,
                          summary_index=0, **fields)

    def close(self, finish: str | None, last: bool = False) -> list[dict]:
        """Ends the open item (finish "length" or "error" marks it incomplete); at the end (last) of a
        stream without any item, an empty message is its output."""
        events: list[dict] = []
        if last and all(item["type"] == "reasoning" for item in self.items):  # no answer yet
            events += self.close(finish)
            events += self._add(message_item("", "in_progress"))
            events.append(self._at("response.content_part.added", part=text_part("")))
        if self.open is None:
            return events
        item = self.items[self.open]
        item["status"] = "incomplete" if finish in ("length", "error") else "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events.append(self._at("response.reasoning_text.done", text=text))
            events.append(self._at("response.content_part.done", part=reasoning_part(text)))
            if self.summarized:
                events.append(self._summary("response.reasoning_summary_text.done", text=text))
                events.append(self._summary("response.reasoning_summary_part.done",
                                            part=summary_part(text)))
        elif item["type"] == "message":
            item["content"][0]["logprobs"] += self.pending_logprobs
            self.pending_logprobs = []
            text, logprobs = item["content"][0]["text"], item["content"][0]["logprobs"]
            events.append(self._at("response.output_text.done", text=text, logprobs=logprobs))
            events.append(self._at("response.content_part.done", part=text_part(text, logprobs)))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=self.open, arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=self.open, item=item))
        self.open = None
        return events
