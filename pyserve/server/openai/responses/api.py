"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}, POST
/v1/responses/{response_id}/cancel and POST /v1/responses/input_tokens: the Responses API as
a translation onto the chat path (serving.chat_result), with the server's ResponseStore and its
background runs."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

import orjson

from pyserve.server.errors import APIError
from pyserve.server.hosted_tools import log_left_out
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.messages import tool_mode
from pyserve.server.openai.params import field
from pyserve.server.openai.serving import off_loop_for_large_body
from pyserve.server.values import brief
from pyserve.server.openai.responses.background import KEPT_EVENT_LOGS, BackgroundRuns
from pyserve.server.openai.responses.output import UNFINISHED, UNREAD, Turn, sse
from pyserve.server.openai.responses.store import ResponseStore, Stored
from pyserve.server.openai.responses.items import with_answer
from pyserve.server.openai.responses.translate import PARAMS, chat_body, check_fields, hosted_tools
from pyserve.server.strict_json import json_bytes

logger = logging.getLogger("pyserve.requests")


@functools.cache
def _log_no_auto_tools() -> None:
    logger.warning("A Responses request gives tools with tool_choice \"auto\", but the server was "
                   "started without --enable-auto-tool-choice and --tool-call-parser: the tools are "
                   "shown to the model and its answer is read as text (as vLLM does); this is logged once")


def _stream_failed(turn: Turn, message: str, sent: int) -> bytes:
    """The end of a stream whose events raised (http.StreamingResponse.on_error), as an engine
    failure ends one: response.failed (each chunk was one event, so `sent` is its number)."""
    failed = turn.response("failed", [], error={"code": "server_error", "message": message})
    return sse({"type": "response.failed", "sequence_number": sent, "response": failed})


class ResponsesAPI:
    def __init__(self, serving, store: ResponseStore):
        self.serving = serving  # OpenAIServing
        self.store = store
        self.runs = BackgroundRuns(store)

    def _history(self, body: dict, owner: int | None) -> list[dict]:
        """The conversation previous_response_id names ([] without one), if owner's."""
        previous = field(body, "previous_response_id", str)
        if previous is None:
            return []
        entry = self.store.get(previous, owner)
        if entry is None:
            raise APIError(404, f"Previous response with id '{previous}' not found.",
                           "previous_response_id")
        status = entry.response["status"]
        if status in UNFINISHED:  # its conversation has no answer yet
            raise APIError(400, f"Previous response with id '{previous}' is still {status}: "
                           "poll it until it ends, then continue from it", "previous_response_id")
        return entry.conversation

    async def create(self, request: Request) -> Response | StreamingResponse:
        body = self.serving.parse_body(request)
        check_fields(body)  # before the store is consulted
        owner = request.api_key_index
        chat, conversation = await off_loop_for_large_body(request, chat_body, body,
                                                            self._history(body, owner))
        if (chat.get("tools") and chat.get("tool_choice") in (None, "auto")
                and not self.serving.config.enable_auto_tool_choice):
            # vLLM's Responses reads no tool calls then: the tools are in the prompt, the
            # answer is text (the chat route refuses "auto" without the flag)
            _log_no_auto_tools()
            chat["tool_choice"] = "none"
        keep = field(body, "store", bool, True)
        turn = Turn(body, self.serving.defaults, self.serving.model_name)
        log_left_out(turn.id, hosted_tools(body.get("tools")))
        try:
            result = await self.serving.chat_result(request, chat, fit_max_tokens=True,
                                                    drop_old_turns=body.get("truncation") == "auto",
                                                    report_cached=True)
        except APIError as exc:  # name the Responses field, not the chat field it became
            raise APIError(exc.status, exc.message, PARAMS.get(exc.param, exc.param),
                           exc.headers) from None
        streamed = field(body, "stream", bool, False)
        if field(body, "background", bool, False):  # chat_body asked for a stream
            entry = self.runs.start(turn, result, conversation, streamed, owner)
            if streamed:
                return StreamingResponse(200, entry.events.read())
            return Response(200, orjson.dumps(entry.response))
        if streamed:
            return StreamingResponse(200, self._stream(turn, result, conversation, keep, owner),
                                     on_error=functools.partial(_stream_failed, turn))
        response = turn.from_completion(result)
        if keep:
            self._keep(turn, response, conversation, owner)
        return Response(200, json_bytes(response))

    async def input_tokens(self, request: Request) -> Response:
        """POST /v1/responses/input_tokens: the prompt a create with this body would render
        (instructions, previous_response_id's conversation, tools), counted in tokens."""
        body = self.serving.parse_body(request)
        check_fields(body)
        chat, _ = await off_loop_for_large_body(request, chat_body, body,
                                                 self._history(body, request.api_key_index))
        self.serving.check_model(chat.get("model"))
        try:
            ids = await self.serving._chat_prompt(chat, tool_mode(chat, False, False)[1],
                                                  drop_old_turns=body.get("truncation") == "auto")
        except APIError as exc:  # name the Responses field, not the chat field it became
            raise APIError(exc.status, exc.message, PARAMS.get(exc.param, exc.param)) from None
        return Response(200, orjson.dumps({"object": "response.input_tokens", "input_tokens": len(ids)}))

    async def _stream(self, turn: Turn, chunks, conversation: list[dict],
                      keep: bool, owner: int | None) -> AsyncIterator[bytes]:
        try:  # closing it at any event ends the chat stream (read or not: ChunkStream.aclose)
            done: list[dict] = []
            async for event in turn.events(chunks, UNREAD, done):
                yield sse(event)
            if keep and done:
                self._keep(turn, done[0], conversation, owner)
        finally:
            await chunks.aclose()

    def _keep(self, turn: Turn, response: dict, conversation: list[dict], owner: int | None) -> None:
        self.store.put(response, with_answer(conversation, response["output"], turn.continues), owner)

    def _stored(self, request: Request) -> tuple[str, Stored]:
        """The stored response the path names, if the request's key made it (else 404, as for
        an id never stored: another key's responses do not exist for it)."""
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id, request.api_key_index)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return response_id, entry

    async def retrieve(self, request: Request) -> Response | StreamingResponse:
        """The stored response as it stands; ?stream=true replays a background stream's events
        after ?starting_after (a sequence number), then follows them while it runs."""
        query = {key: values[-1] for key, values in parse_qs(request.target.partition("?")[2]).items()}
        _, entry = self._stored(request)
        if query.get("stream", "false").lower() != "true":
            return Response(200, json_bytes(entry.response))
        if entry.events is None:
            raise APIError(400, "only a response created with background and stream true can be "
                           f"streamed again, while among the {KEPT_EVENT_LOGS} most recent such; GET "
                           "it without stream", "stream")
        after = query.get("starting_after")
        if after is not None and not (after.isascii() and after.isdigit() and len(after) < 19):
            raise APIError(400, f"starting_after must be a sequence number (0 or more), got "
                           f"{brief(after)}", "starting_after")
        return StreamingResponse(200, entry.events.read(0 if after is None else int(after) + 1))

    async def delete(self, request: Request) -> Response:
        """Deletes a stored response; a background one still running is cancelled first, so
        nothing runs for a response nobody can reach."""
        response_id, _ = self._stored(request)
        await self.runs.cancel(response_id)
        self.store.delete(response_id)
        return Response(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))

    async def cancel(self, request: Request) -> Response:
        """Cancels a background response that is running (queued or in_progress): it ends
        "cancelled". Cancelling one again answers it as it is; a response created without
        background, or one that ended otherwise, cannot be cancelled (400, vLLM's words)."""
        response_id, entry = self._stored(request)
        if self.runs.is_running(response_id):
            await self.runs.cancel(response_id)
        elif not entry.response["background"]:
            raise APIError(400, "Cannot cancel a synchronous response.", "response_id")
        elif entry.response["status"] != "cancelled":
            raise APIError(400, f"Cannot cancel response '{response_id}': it has already ended "
                           f"({entry.response['status']}).", "response_id")
        return Response(200, orjson.dumps(entry.response))
