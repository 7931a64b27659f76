"""POST /v1/responses, GET and DELETE /v1/responses/{response_id}: the Responses API as a
translation onto the chat path (serving.chat_result), with the server's ResponseStore."""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import parse_qs

import orjson

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.openai.params import field
from pyserve.server.openai.responses.output import Turn
from pyserve.server.openai.responses.store import ResponseStore
from pyserve.server.openai.responses.translate import PARAMS, chat_body, check_fields, input_messages


def sse(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponsesAPI:
    def __init__(self, serving, store: ResponseStore):
        self.serving = serving  # OpenAIServing
        self.store = store

    async def create(self, request: Request) -> Response | StreamingResponse:
        body = self.serving.parse_body(request)
        check_fields(body)  # before the store is consulted
        history: list[dict] = []
        previous = field(body, "previous_response_id", str)
        if previous is not None:
            entry = self.store.get(previous)
            if entry is None:
                raise APIError(404, f"Previous response with id '{previous}' not found.",
                               "previous_response_id")
            history = entry[1]
        chat, conversation = chat_body(body, history)
        keep = field(body, "store", bool, True)
        turn = Turn(body, self.serving.defaults, self.serving.model_name)
        try:
            result = await self.serving.chat_result(request, chat)
        except APIError as exc:  # name the Responses field, not the chat field it became
            raise APIError(exc.status, exc.message, PARAMS.get(exc.param, exc.param),
                           exc.headers) from None
        if chat.get("stream"):
            return StreamingResponse(200, self._stream(turn, result, conversation, keep))
        response = turn.from_completion(result)
        if keep:
            self._keep(response, conversation)
        return Response(200, orjson.dumps(response))

    async def _stream(self, turn: Turn, chunks, conversation: list[dict],
                      keep: bool) -> AsyncIterator[bytes]:
        try:
            # read before the first event, so that closing this stream always ends the chat one
            first = await anext(chunks, None)
            done: list[dict] = []
            async for event in turn.events(chunks, first, done):
                yield sse(event)
            if keep and done:
                self._keep(done[0], conversation)
        finally:
            await chunks.aclose()

    def _keep(self, response: dict, conversation: list[dict]) -> None:
        self.store.put(response, conversation + input_messages(response["output"], "output"))

    def _stored(self, request: Request) -> tuple[str, dict]:
        response_id = request.path_params["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return response_id, entry[0]

    async def retrieve(self, request: Request) -> Response:
        query = parse_qs(request.target.partition("?")[2])
        if query.get("stream", ["false"])[-1].lower() == "true":
            raise APIError(400, "streaming a stored response is not supported by this server", "stream")
        return Response(200, orjson.dumps(self._stored(request)[1]))

    async def delete(self, request: Request) -> Response:
        response_id, _ = self._stored(request)
        self.store.delete(response_id)
        return Response(200, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))
