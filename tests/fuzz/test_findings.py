"""What the fuzzers found, kept as tests. Each one runs the real HTTPProtocol through
tests/fuzz/http_wire.py's fake transport and strict reader."""

import asyncio
import logging

import pytest

from pyserve.server.http import HTTPLimits
from tests.fuzz.http_wire import LAST_WORDS, App, Malformed, exchange


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()
    asyncio.set_event_loop(None)


def test_the_wire_reader_accepts_what_the_protocol_gets_right(loop):
    """The reader is strict, not broken: pipelined, chunked, HEAD, 100-continue, refusals."""
    logging.disable(logging.CRITICAL)
    try:
        for stream in (b"HEAD /h HTTP/1.1\r\n\r\nGET /stream HTTP/1.1\r\n\r\n",
                       b"POST /p HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello",
                       b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                       b"GET /raise HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n",
                       b"GET / HTTP/1.1\r\n\r\nGET\x01 / HTTP/1.1\r\n\r\n"):
            for pieces in (1, 3):
                exchange(stream, pieces, HTTPLimits(), App(), loop)
        with pytest.raises(Malformed):  # and it does refuse: a body short of its length
            from tests.fuzz.http_wire import check

            check(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nabc", App(), 0)
    finally:
        logging.disable(logging.NOTSET)


def test_an_upgrade_request_gets_one_response(loop):
    """Found by tests/fuzz/fuzz_http.py: an Upgrade request was answered, then given a second,
    unsolicited 400 'protocol upgrades are not supported'."""
    exchange(b"GET /a HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", 1,
             HTTPLimits(), App(), loop)


def test_a_streamed_answer_to_head_has_no_body(loop):
    """Found by tests/fuzz/fuzz_http.py: a streamed response's chunked body was written to a
    HEAD request (no GET route streams today)."""
    exchange(b"HEAD /stream HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n", 1, HTTPLimits(),
             App(), loop)


def test_a_stream_that_raises_still_ends(loop):
    """Issue 68: a lone surrogate in model text made a stream's chunks raise (orjson refuses
    it); the connection's task died and the client waited forever for the stream's end. Now
    the route's last words and the chunked body's end go out, and the connection closes."""
    logging.disable(logging.CRITICAL)
    try:
        transport = exchange(b"GET /broken HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n", 1,
                             HTTPLimits(), App(), loop)
    finally:
        logging.disable(logging.NOTSET)
    body = bytes(transport.written).partition(b"\r\n\r\n")[2]
    assert body == (b"9\r\ndata: 1\n\n\r\n" + b"%x\r\n%b\r\n" % (len(LAST_WORDS), LAST_WORDS)
                    + b"0\r\n\r\n")
    assert transport.closed
