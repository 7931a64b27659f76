"""GET /load: vLLM's server-load figure, the requests in flight on the routes that run the model.

As vLLM counts it (vllm/entrypoints/serve/utils/api_utils.py, load_aware_call), and only with
--enable-server-load-tracking; without it /load still answers, with {"server_load": 0}. A
request counts from the moment its route is entered until its answer is complete: a plain
response when the handler returns it (an error too), a stream when its last chunk is written
or the client goes away. /invocations counts once, as the route it hands the body to."""

from __future__ import annotations

import orjson

from pyserve.server.http import Handler, Request, Response, StreamingResponse

# vLLM's load-aware routes that pyserve serves (its comment on /load lists them)
TRACKED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/messages",
                           "/v1/responses", "/v1/embeddings", "/invocations"})
TRACKED_PREFIXES = ("/v1/responses/",)  # GET /v1/responses/{response_id}, as vLLM's


def is_tracked(path: str) -> bool:
    return path in TRACKED_PATHS or path.startswith(TRACKED_PREFIXES)


class ServerLoad:
    """Invariant: in_flight is the number of tracked requests entered and not yet answered."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.in_flight = 0

    async def call(self, path: str, handler: Handler,
                   request: Request) -> Response | StreamingResponse:
        """handler(request), counted while it runs when path is tracked."""
        if not (self.enabled and is_tracked(path)):
            return await handler(request)
        self.in_flight += 1
        try:
            response = await handler(request)
        except BaseException:  # an APIError (a 4xx) or a cancelled request: answered now
            self.in_flight -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.chunks = _CountedStream(response.chunks, self._release)
        else:
            self.in_flight -= 1
        return response

    def _release(self) -> None:
        self.in_flight -= 1

    async def handler(self, request: Request) -> Response:
        return Response(200, orjson.dumps({"server_load": self.in_flight}))


class _CountedStream:
    """A stream's chunks; `done` runs once, when they run out, fail or are closed (the HTTP
    writer closes every stream it was given, read to the end or not)."""

    def __init__(self, chunks, done):
        self._chunks = chunks
        self._done = done

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except BaseException:  # the end (StopAsyncIteration) or a failure
            self._finish()
            raise

    async def aclose(self) -> None:
        try:
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._finish()

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()
