"""The /v1/messages routes on OpenAIServing: one engine path, the chat one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson

from pyserve.server.anthropic.request import chat_body, server_tools, thinking_omitted
from pyserve.server.anthropic.response import MessageEvents, error_event, message, message_id
from pyserve.server.errors import APIError, anthropic_error_response
from pyserve.server.hosted_tools import log_left_out
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.strict_json import json_bytes
from pyserve.server.openai.messages import tool_mode
from pyserve.server.openai.serving import json_object, off_loop_for_large_body

logger = logging.getLogger("pyserve")


def _event(kind: str, data: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"


def _stream_failed(message: str, sent: int) -> bytes:
    """The end of a stream whose events raised (http.StreamingResponse.on_error)."""
    return _event(*error_event(500, message))


PING_S = 10.0  # seconds between pings while a stream waits for its next chunk
_PING = _event("ping", {"type": "ping"})


def _refusal(exc: APIError) -> Response:
    response = anthropic_error_response(exc.status, exc.message)
    response.headers.extend(exc.headers)
    return response


class AnthropicServing:
    def __init__(self, serving):
        """serving: the server's OpenAIServing."""
        self.serving = serving

    async def _request(self, request: Request, route: str) -> tuple[dict, list[str], bool, list[str]]:
        """(the chat body, the stop sequences, whether thinking text is left out, the types of
        the server tools left out of the prompt)."""
        raw = json_object(request)
        body, stops = await off_loop_for_large_body(request, chat_body, raw, route)
        self.serving.check_model(body["model"])
        return body, stops, thinking_omitted(raw), list(server_tools(raw.get("tools")).values())

    async def messages(self, request: Request) -> Response | StreamingResponse:
        try:
            body, stops, omitted, left_out = await self._request(request, "messages")
            result = await self.serving.chat_result(request, body)
            log_left_out(message_id(result.id if body.get("stream") else result["id"]), left_out)
            if not body.get("stream"):
                return Response(200, json_bytes(message(result, stops, omitted)))
        except APIError as exc:
            return _refusal(exc)
        except Exception as exc:  # a failed step (the stream's own failure is an error event)
            logger.exception("generation failed")
            return anthropic_error_response(500, f"generation failed: {exc}")
        return StreamingResponse(200, self._events(result, stops, omitted), on_error=_stream_failed)

    async def _events(self, chunks, stops: list[str], omitted: bool) -> AsyncIterator[bytes]:
        """message_start and a ping at once (as Anthropic sends them: a long prompt's prefill
        must not look like a dead stream to a client's idle watchdog), a ping every PING_S
        until the first chunk comes, then the chunks' events. (Only the first read is a task
        that can be waited on with a timeout: the later ones, a token apart, are read plainly.)"""
        events = MessageEvents(stops, omitted)
        pending = None
        try:
            for kind, data in events.start(chunks.id, chunks.model, chunks.prompt_tokens):
                yield _event(kind, data)
            yield _PING
            pending = asyncio.ensure_future(anext(chunks, None))
            while not (await asyncio.wait({pending}, timeout=PING_S))[0]:
                yield _PING
            chunk, pending = pending.result(), None
            while chunk is not None:
                for kind, data in events.feed(chunk):
                    yield _event(kind, data)
                if events.failed:
                    return
                chunk = await anext(chunks, None)
            for kind, data in events.close():
                yield _event(kind, data)
        finally:  # a client gone, an engine failure: the chat stream discards its requests
            if pending is not None:  # the read in flight is cancelled first (its generator runs)
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await chunks.aclose()

    async def count_tokens(self, request: Request) -> Response:
        """{"input_tokens": N}: the translated request's prompt as the chat template renders it."""
        try:
            body, _, _, _ = await self._request(request, "count_tokens")
            ids = await self.serving._chat_prompt(body, tool_mode(body, False, False)[1])
        except APIError as exc:
            return _refusal(exc)
        return Response(200, orjson.dumps({"input_tokens": len(ids)}))
