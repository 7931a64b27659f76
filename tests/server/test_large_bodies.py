"""A large request body's JSON is parsed in a worker thread before its handler runs (the
router's prepare hook, server/openai/serving.py preparse_json); small bodies and every error's
wording stay as they were."""

import threading

import orjson
import pytest
import uvloop

from pyserve.server.errors import APIError
from pyserve.server.http import Request, Response
from pyserve.server.openai import serving
from pyserve.server.router import Router


def route(record):
    router = Router(lambda status, message: Response(status, message.encode()), serving.preparse_json)

    async def handler(request):
        try:
            body = serving.json_object(request)
        except APIError as exc:
            return Response(exc.status, exc.message.encode())
        record.append(body)
        return Response(200, b"ok")

    router.add("POST", "/v1/x", handler)
    return router


@pytest.fixture
def parse_threads(monkeypatch):
    """The threads orjson.loads ran on, for the module's parses."""
    threads = []
    real = serving.orjson.loads

    def loads(data):
        threads.append(threading.current_thread())
        return real(data)

    monkeypatch.setattr(serving.orjson, "loads", loads)
    return threads


def post(router, body: bytes):
    return uvloop.run(router(Request("POST", "/v1/x", {}, body)))


def test_a_large_body_is_parsed_off_the_loop_once(parse_threads):
    record = []
    big = {"prompt": "x" * (serving.OFF_LOOP_BODY_BYTES + 10), "max_tokens": 3}
    response = post(route(record), orjson.dumps(big))
    assert response.status == 200 and record == [big]
    assert len(parse_threads) == 1 and parse_threads[0] is not threading.main_thread()


def test_a_small_body_is_parsed_on_the_loop(parse_threads):
    record = []
    assert post(route(record), b'{"prompt": "hi"}').status == 200
    assert record == [{"prompt": "hi"}] and parse_threads == [threading.main_thread()]


@pytest.mark.parametrize("pad", [0, serving.OFF_LOOP_BODY_BYTES])
def test_errors_read_the_same_on_and_off_the_loop(pad):
    filler = " " * pad
    for body, expected in [(b'[1, 2]' + filler.encode(), "request body must be a JSON object"),
                           (b'{"temperature": NaN' + filler.encode() + b'}', "NaN is not a JSON number"),
                           (b'[' * 2000 + b']' * 2000 + filler.encode(), "nests more than")]:
        response = post(route([]), body)
        assert response.status == 400 and expected in response.body.decode()
