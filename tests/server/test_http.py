"""The HTTP/1.1 layer over real loopback sockets on uvloop: keep-alive, pipelining, chunked
bodies, 100-continue, HEAD, limits, malformed input, streaming with backpressure, disconnects
and timeouts."""

import asyncio
import json

import pytest
import uvloop

from pyserve.server.http import HTTPLimits, HTTPProtocol, Response, StreamingResponse
from pyserve.server.router import Router, normalize_path


def error_response(status, message):
    return Response(status, json.dumps({"error": {"message": message}}).encode())


class App:
    """A router with a few test routes; records what streams saw."""

    def __init__(self):
        self.stream_closed = asyncio.Event()
        self.produced = 0
        self.router = Router(error_response)
        self.router.add("POST", "/echo", self.echo)
        self.router.add("GET", "/hello", self.hello)
        self.router.add("GET", "/stream", self.stream)
        self.router.add("GET", "/firehose", self.firehose)

    async def echo(self, request):
        return Response(200, json.dumps({"len": len(request.body), "body": request.body.decode()}).encode())

    async def hello(self, request):
        return Response(200, b'{"hello": "world"}')

    async def stream(self, request):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)
        return StreamingResponse(200, chunks())

    async def firehose(self, request):
        async def chunks():
            try:
                while True:
                    self.produced += 1
                    yield b"x" * 65536
            finally:
                self.stream_closed.set()
        return StreamingResponse(200, chunks())


async def start(app, limits=HTTPLimits()):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HTTPProtocol(app.router, limits), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def read_response(reader):
    """One response: (status, headers, body), de-chunking streamed bodies."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                return status, headers, body
            body += await reader.readexactly(size)
            await reader.readline()
    length = int(headers.get("content-length", 0))
    return status, headers, await reader.readexactly(length) if length else b""


def run(test):
    async def main():
        app = App()
        server, port = await start(app)
        try:
            return await test(app, port)
        finally:
            server.close()
    return uvloop.run(main())


def test_keep_alive_and_pipelining():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"a": 1}'
        writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
                     b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n" % (len(body), body))
        first, second, third = [await read_response(reader) for _ in range(3)]
        assert first[0] == 200 and json.loads(first[2]) == {"hello": "world"}
        assert second[0] == 200 and json.loads(second[2])["body"] == '{"a": 1}'
        assert third[0] == 200 and third[1]["connection"] == "keep-alive"
        writer.close()
    run(test)


def test_chunked_body_expect_continue_and_head():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 200 and json.loads(body) == {"len": 11, "body": "hello world"}
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readline() == b"HTTP/1.1 100 Continue\r\n"
        await reader.readline()
        writer.write(b"hi")
        status, _, body = await read_response(reader)
        assert json.loads(body)["body"] == "hi"
        writer.write(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        line = await reader.readline()
        headers = {}
        while (h := await reader.readline()) != b"\r\n":
            k, v = h.decode().split(":", 1)
            headers[k.lower()] = v.strip()
        assert b"200" in line and headers["content-length"] == "18"
        status, _, body = await read_response(reader)  # the next response follows directly
        assert status == 200 and body == b'{"hello": "world"}'
        writer.close()
    run(test)


@pytest.mark.parametrize("raw,status", [
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"DELETE /hello HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"8000\r\n" + b"a" * 0x8000 + b"\r\n" + b"8000\r\n" + b"a" * 0x8000 + b"\r\n", 413),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
])
def test_errors_get_their_status(raw, status):
    async def main():
        app = App()
        server, port = await start(app, HTTPLimits(max_body_bytes=40000))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        got, headers, body = await read_response(reader)
        if status == 405:
            assert headers["allow"] == "GET, HEAD"
        assert got == status and "error" in json.loads(body)
        # the server is still fine for everyone else
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(r2))[0] == 200
        writer.close(), w2.close()
        server.close()
    uvloop.run(main())


def test_streaming_and_a_slow_reader_pauses_only_its_own_stream():
    async def test(app, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["content-type"] == "text/event-stream"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

        slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        slow_writer.write(b"GET /firehose HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)
        produced = app.produced
        await asyncio.sleep(0.3)
        assert app.produced == produced  # paused by backpressure, not spinning
        assert produced < 200  # bounded by socket and transport buffers (64 KiB chunks)
        writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")  # others are served meanwhile
        assert (await read_response(reader))[0] == 200
        slow_writer.close()  # the slow client leaves: its stream is closed at once
        await asyncio.wait_for(app.stream_closed.wait(), 2)
        writer.close()
    run(test)


def test_idle_keep_alive_connections_are_closed():
    async def main():
        app = App()
        server, port = await start(app, HTTPLimits(keepalive_timeout_s=0.1, header_timeout_s=0.2))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed by the server
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET /hello HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        assert await asyncio.wait_for(r2.read(), 2) == b""
        server.close()
    uvloop.run(main())


@pytest.mark.parametrize("target,path", [
    ("/v1/models", "/v1/models"), ("//v1/models", "/v1/models"), ("/v1//models/", "/v1/models"),
    ("/v1/%6Dodels?x=1", "/v1/models"), ("/v1/../v1/models", "/v1/models"), ("", "/"),
])
def test_normalize_path(target, path):
    assert normalize_path(target) == path


def test_a_handler_bug_is_a_500_and_the_connection_goes_on():
    async def main():
        app = App()

        async def broken(request):
            raise RuntimeError("a bug of ours")

        app.router.add("GET", "/broken", broken)
        server, port = await start(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\nGET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_response(reader)
        assert status == 500 and json.loads(body)["error"]["code"] == 500
        assert (await read_response(reader))[0] == 200
        writer.close()
        server.close()
    uvloop.run(main())


def _openai_tail():
    from pyserve.server.openai.streaming import stream_failed

    def check(events):
        assert events[-2]["error"]["code"] == 500 and events[-1] == "[DONE]"
    return stream_failed, check


def _responses_tail():
    import functools

    from pyserve.server.openai.responses.api import _stream_failed
    from pyserve.server.openai.responses.output import Turn

    def check(events):
        assert events[-1]["type"] == "response.failed" and events[-1]["sequence_number"] == 2
        assert events[-1]["response"]["status"] == "failed"
    return functools.partial(_stream_failed, Turn({"input": "x"}, {}, "m")), check


def _messages_tail():
    from pyserve.server.anthropic.serving import _stream_failed

    def check(events):
        assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    return _stream_failed, check


@pytest.mark.parametrize("tail", [_openai_tail, _responses_tail, _messages_tail])
def test_a_stream_whose_chunks_raise_still_ends_in_its_routes_words(tail):
    """Issue 68: a chunk that could not be written (a lone surrogate orjson refused) killed the
    connection's task mid-stream; the client waited for an end that never came. Any failure
    of a stream's chunks now ends it: the route's error event and end marker, the chunked
    body's end, and the connection closed."""
    on_error, check = tail()

    async def main():
        app = App()

        async def broken(request):
            async def chunks():
                yield b'data: {"n": 0}\n\n'
                yield b'data: {"n": 1}\n\n'
                raise TypeError("str is not valid UTF-8: surrogates not allowed")
            return StreamingResponse(200, chunks(), on_error=on_error)

        app.router.add("GET", "/broken", broken)
        server, port = await start(app)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after it
        writer.close()
        server.close()
        return status, body

    status, body = uvloop.run(main())
    lines = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    events = [line.decode() if line == b"[DONE]" else json.loads(line) for line in lines]
    assert status == 200 and events[:2] == [{"n": 0}, {"n": 1}]
    check(events)
