"""ServerLoad (GET /load) without sockets: what counts, for how long, and that every way an
answer ends releases it exactly once."""

import asyncio

import orjson
import pytest

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response, StreamingResponse
from pyserve.server.load import ServerLoad


def run(coro):
    return asyncio.run(coro)


async def _chunks(n, fail_at=None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the stream broke")
        yield b"x"


def _request():
    return Request("POST", "/v1/completions", {})


def test_a_plain_answer_counts_while_its_handler_runs():
    load = ServerLoad(enabled=True)
    seen = []

    async def handler(request):
        seen.append(load.in_flight)
        return Response(200, b"{}")

    run(load.call("/v1/completions", handler, _request()))
    assert seen == [1] and load.in_flight == 0


@pytest.mark.parametrize("error", [APIError(400, "bad"), asyncio.CancelledError()])
def test_a_failed_handler_is_released(error):
    load = ServerLoad(enabled=True)

    async def handler(request):
        raise error

    with pytest.raises(type(error)):
        run(load.call("/v1/chat/completions", handler, _request()))
    assert load.in_flight == 0


def test_a_stream_counts_until_it_ends_fails_or_is_closed():
    async def scenario(consume):
        load = ServerLoad(enabled=True)

        async def handler(request):
            return StreamingResponse(200, _chunks(3, fail_at=1 if consume == "fail" else None))

        response = await load.call("/v1/completions", handler, _request())
        assert load.in_flight == 1
        try:
            if consume in ("all", "fail"):
                async for _ in response.chunks:
                    pass
            elif consume == "one":
                await response.chunks.__anext__()
                assert load.in_flight == 1
        except RuntimeError:
            pass
        await response.chunks.aclose()  # the HTTP writer always closes the stream
        await response.chunks.aclose()
        return load.in_flight

    for consume in ("all", "fail", "one", "none"):
        assert run(scenario(consume)) == 0, consume


def test_only_the_generation_routes_count_and_only_when_enabled():
    async def handler(request):
        return StreamingResponse(200, _chunks(1))

    load = ServerLoad(enabled=True)
    for path in ("/tokenize", "/v1/models", "/metrics", "/v1/messages/count_tokens"):
        run(load.call(path, handler, _request()))
        assert load.in_flight == 0, path
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses",
                 "/v1/responses/resp_1", "/v1/embeddings", "/invocations"):
        run(load.call(path, handler, _request()))
    assert load.in_flight == 7  # their streams are still open
    off = ServerLoad(enabled=False)
    run(off.call("/v1/completions", handler, _request()))
    assert off.in_flight == 0


def test_the_route_answers_vllms_shape():
    load = ServerLoad(enabled=False)
    response = run(load.handler(_request()))
    assert response.status == 200 and orjson.loads(response.body) == {"server_load": 0}
