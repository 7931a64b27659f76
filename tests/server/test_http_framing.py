"""Request smuggling and framing shapes: each is answered 400 (431, 408 where the limit says so)
and the connection closed, over loopback sockets on uvloop and byte by byte through a fake
transport (a message split anywhere is refused the same); response headers never carry CR/LF."""

import asyncio
import json

import pytest
import uvloop

from pyserve.config import Config, ServerConfig
from pyserve.server.app import ServerState
from pyserve.server.http import HTTPLimits, HTTPProtocol, Response, _head
from pyserve.server.router import Router

LIMITS = HTTPLimits(max_body_bytes=40000, body_timeout_s=0.3)
POST = b"POST /echo HTTP/1.1\r\nHost: x\r\n"
CHUNKED = POST + b"Transfer-Encoding: chunked\r\n\r\n"

# name -> raw request; every one is refused with 400 and the connection closed
BAD = {
    "CL and TE": POST + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE and CL": POST + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "CL.TE smuggle": POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nG",
    "duplicate CL, same": POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "duplicate CL, different": POST + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "CL list": POST + b"Content-Length: 5, 5\r\n\r\nhello",
    "CL +5": POST + b"Content-Length: +5\r\n\r\nhello",
    "CL 0x5": POST + b"Content-Length: 0x5\r\n\r\nhello",
    "CL 5 5": POST + b"Content-Length: 5 5\r\n\r\nhello",
    "CL -5": POST + b"Content-Length: -5\r\n\r\nhello",
    "CL empty": POST + b"Content-Length: \r\n\r\nhello",
    "CL overflow": POST + b"Content-Length: 99999999999999999999999\r\n\r\nhello",
    "TE xchunked": POST + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "TE chunked, gzip": POST + b"Transfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n",
    "TE gzip, chunked": POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "TE gzip": POST + b"Transfer-Encoding: gzip\r\n\r\n",
    "TE identity": POST + b"Transfer-Encoding: identity\r\n\r\n",
    "TE twice": POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE and TE cow": POST + b"Transfer-Encoding: chunked\r\nTransfer-encoding: cow\r\n\r\n0\r\n\r\n",
    "TE on HTTP/1.0": b"POST /echo HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "space before colon": POST + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "tab before colon": POST + b"Transfer-Encoding\t: chunked\r\n\r\n0\r\n\r\n",
    "vertical tab in value": POST + b"Transfer-Encoding: \x0bchunked\r\n\r\n0\r\n\r\n",
    "CR in value": POST + b"Transfer-Encoding: chun\rked\r\n\r\n0\r\n\r\n",
    "NUL in value": POST + b"X-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
    "obs-fold": POST + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
    "CR in name": POST + b"Transfer\r-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "tab in name": POST + b"Transfer\t-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "space before first header": b"POST /echo HTTP/1.1\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bare LF line ends": b"POST /echo HTTP/1.1\nHost: x\nContent-Length: 2\n\nhi",
    "chunk size not hex": CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n",
    "chunk size 0x5": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk size -5": CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n",
    "chunk size, space": CHUNKED + b"5 \r\nhello\r\n0\r\n\r\n",
    "chunk size over 2^64": CHUNKED + b"1" + b"0" * 16 + b"\r\nhello\r\n0\r\n\r\n",
    # llhttp takes sizes up to 2^64 - 1; from 2^63 on they are refused at once, not timed out
    "chunk size 2^63": CHUNKED + b"8000000000000000\r\nhello\r\n0\r\n\r\n",
    "chunk size 2^64 - 1": CHUNKED + b"ffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "chunk size 2^63, extension": CHUNKED + b"8000000000000000;a=b\r\nhello\r\n0\r\n\r\n",
    "chunk size 2^63, leading zeros": CHUNKED + b"0000" + b"8" + b"0" * 15 + b"\r\nhello\r\n",
    "chunk size 2^63, second chunk": CHUNKED + b"5\r\nhello\r\nC000000000000000\r\nhello\r\n",
    "chunk size, bare LF": CHUNKED + b"5\nhello\n0\n\n",
    "chunk data without CRLF": CHUNKED + b"5\r\nhelloXX0\r\n\r\n",
    "chunk data, bare LF": CHUNKED + b"5\r\nhello\n0\r\n\r\n",
    "HTTP/1.2": b"GET /echo HTTP/1.2\r\nHost: x\r\n\r\n",
}


async def echo(request):
    return Response(200, json.dumps({"body": request.body.decode("latin-1")}).encode())


async def split_header(request):
    return Response(200, b"{}", [("x-ok", "1"), ("x-evil", "a\r\nset-cookie: pwned=1"),
                                 ("x-evil\r\nset-cookie", "pwned=1")])


def router():
    r = Router(lambda status, message: Response(status, json.dumps({"error": message}).encode()))
    r.add("POST", "/echo", echo)
    r.add("GET", "/echo", echo)
    r.add("GET", "/split", split_header)
    return r


async def serve(handler, limits=LIMITS):
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HTTPProtocol(handler, limits), "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def exchange(port, raw, timeout=3.0):
    """Everything the server writes until it closes: (status, headers, raw bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    data = await asyncio.wait_for(reader.read(), timeout)  # b"" unless closed: it must close
    writer.close()
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = [tuple(part.strip() for part in line.split(":", 1)) for line in head[1:]]
    return int(head[0].split()[1]), headers, data


def test_every_bad_framing_is_a_400_and_a_close():
    async def main():
        server, port = await serve(router())
        for name, raw in BAD.items():
            status, headers, data = await exchange(port, raw)
            assert status == 400, (name, data)
            assert ("connection", "close") in headers, name
            assert data.count(b"HTTP/1.1") == 1, name  # nothing smuggled behind it was answered
        # and the server answers well-framed requests as before
        status, _, data = await exchange(port, POST + b"Content-Length: 5\r\nConnection: close\r\n\r\nhello")
        assert status == 200 and data.endswith(b'{"body": "hello"}')
        server.close()
    uvloop.run(main())


def test_a_refusal_behind_pipelined_requests_comes_after_their_answers():
    async def main():
        server, port = await serve(router())
        for name in ("CL.TE smuggle", "TE gzip, chunked", "chunk data without CRLF"):
            first = POST + b"Content-Length: 2\r\n\r\nhi"
            status, _, data = await exchange(port, first + first + BAD[name])
            assert status == 200 and data.count(b"HTTP/1.1 200 ") == 2, name
            assert data.count(b"HTTP/1.1 ") == 3 and b"HTTP/1.1 400 " in data.split(b"hi\"}")[-1]
        server.close()
    uvloop.run(main())


@pytest.mark.parametrize("raw,body", [
    (POST + b"Content-Length:  5 \r\nConnection: close\r\n\r\nhello", "hello"),  # OWS around it
    (POST + b"Transfer-Encoding: Chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
     "hello"),  # coding names are case-insensitive (RFC 9112 7)
    (POST + b"Transfer-Encoding:\tchunked\r\nConnection: close\r\n\r\n5;a=b\r\nhello\r\n0\r\n\r\n",
     "hello"),  # tab is whitespace; a chunk extension is ignored
    (POST + b"Content-Length: 0005\r\nConnection: close\r\n\r\nhello", "hello"),
])
def test_well_framed_variants_are_served(raw, body):
    async def main():
        server, port = await serve(router())
        status, _, data = await exchange(port, raw)
        assert status == 200 and json.loads(data.split(b"\r\n\r\n", 1)[1])["body"] == body
        server.close()
    uvloop.run(main())


def test_header_count_cap_is_a_431():
    async def main():
        server, port = await serve(router())
        def request(n):  # Host, n others, Connection
            lines = b"".join(b"X-%d: v\r\n" % i for i in range(n))
            return b"GET /echo HTTP/1.1\r\nHost: x\r\n" + lines + b"Connection: close\r\n\r\n"
        assert (await exchange(port, request(255)))[0] == 431  # 257 headers
        assert (await exchange(port, request(254)))[0] == 200  # 256: the cap
        server.close()
    uvloop.run(main())


@pytest.mark.parametrize("raw", [
    POST + b"Content-Length: 10\r\n\r\nabc",  # a declared length that never arrives
    CHUNKED + b"5\r\nhello\r\n",  # a chunked body that never ends
    CHUNKED + b"9c40\r\nhello\r\n",  # a chunk of the body limit whose bytes never come
])
def test_slow_bodies_get_408_at_the_body_timeout(raw):
    async def main():
        server, port = await serve(router())
        t0 = asyncio.get_running_loop().time()
        status, headers, _ = await exchange(port, raw)
        waited = asyncio.get_running_loop().time() - t0
        assert status == 408 and ("connection", "close") in headers
        assert 0.25 < waited < 2.0
        server.close()
    uvloop.run(main())


@pytest.mark.parametrize("size", [b"9c41", b"7fffffffffffffff"])  # the limit + 1, 2^63 - 1
def test_a_chunk_past_the_body_limit_is_a_413_at_once(size):
    async def main():
        server, port = await serve(router(), HTTPLimits(max_body_bytes=40000, body_timeout_s=30))
        for raw in (CHUNKED + size + b"\r\nhello", CHUNKED + b"3\r\nabc\r\n9c3e\r\n"):
            status, headers, _ = await exchange(port, raw, timeout=5)  # not the 30 s body timeout
            assert status == 413 and ("connection", "close") in headers
        status, _, data = await exchange(port, CHUNKED.replace(b"\r\n\r\n", b"\r\nConnection: "
                                         b"close\r\n\r\n") + b"3\r\nabc\r\n9c3d\r\n" + b"x" * 39997
                                         + b"\r\n0\r\n\r\n")  # exactly the limit: served
        assert status == 200 and len(json.loads(data.split(b"\r\n\r\n", 1)[1])["body"]) == 40000
        server.close()
    uvloop.run(main())


def test_pipelined_bodies_full_of_line_feeds_are_framed_alike():
    """Bodies are fed to llhttp whole, lines one by one: the cut never changes a message."""
    async def main():
        server, port = await serve(router())
        body = b"\n" * 3000 + b"8000000000000000\r\n"  # LF-heavy, with a size-like line
        chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
        raw = (POST + b"Content-Length: %d\r\n\r\n%b" % (len(body), body) + CHUNKED + chunked
               + POST + b"Connection: close\r\nContent-Length: 2\r\n\r\nok")
        _, _, data = await exchange(port, raw)
        bodies = [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["body"]
                  for part in data.split(b"HTTP/1.1 200 OK")[1:]]
        assert bodies == [body.decode(), body.decode(), "ok"]
        server.close()
    uvloop.run(main())


def test_the_body_timer_is_not_replaced_by_keep_alive_after_an_answer():
    async def main():
        limits = HTTPLimits(body_timeout_s=0.6, keepalive_timeout_s=0.1)
        server, port = await serve(router(), limits)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(POST + b"Content-Length: 1\r\n\r\na" + POST + b"Content-Length: 2\r\n\r\nb")
        await asyncio.sleep(0.3)  # past the keep-alive timeout, within the body timeout
        writer.write(b"c")
        data = b""
        while data.count(b"HTTP/1.1 200") < 2:
            data += await asyncio.wait_for(reader.read(4096), 2)
        assert data.endswith(b'{"body": "bc"}')
        writer.close()
        server.close()
    uvloop.run(main())


def test_a_response_header_with_cr_or_lf_is_dropped():
    async def main():
        server, port = await serve(router())
        status, headers, data = await exchange(port, b"GET /split HTTP/1.1\r\nHost: x\r\n"
                                               b"Connection: close\r\n\r\n")
        assert status == 200 and ("x-ok", "1") in headers
        assert b"pwned" not in data and not any(name == "set-cookie" for name, _ in headers)
        server.close()
    uvloop.run(main())
    assert b"\r\n\r\n" not in _head(200, [("a", "b\nc")], True)[:-4]


@pytest.mark.parametrize("origin", [b"http://a\nSet-Cookie: x=1",  # (CRLF just ends the line)
                                    b"http://a\rSet-Cookie: x=1", b"http://a\x00b"])
def test_client_values_echoed_in_headers_cannot_split_them(origin):
    """Origin (echoed by CORS with credentials) and X-Request-Id (echoed) reach response
    headers; llhttp refuses CR, LF and NUL in them before any handler runs."""
    async def main():
        config = Config(server=ServerConfig(allowed_origins=("*",), allow_credentials=True,
                                            enable_request_id_headers=True))
        server, port = await serve(ServerState(config).handle)  # loading: /health answers 503
        for name in (b"Origin", b"X-Request-Id", b"Access-Control-Request-Headers"):
            raw = (b"OPTIONS /health HTTP/1.1\r\nHost: x\r\nAccess-Control-Request-Method: GET\r\n"
                   b"Origin: http://a\r\n%s: %s\r\n\r\n" % (name, origin))
            status, headers, data = await exchange(port, raw)
            assert status == 400 and b"x=1" not in data.split(b"\r\n\r\n")[0], name
        status, headers, _ = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                            b"Origin: http://a\r\nX-Request-Id: abc\r\n"
                                            b"Connection: close\r\n\r\n")
        assert status == 503 and ("access-control-allow-origin", "http://a") in headers
        assert ("x-request-id", "abc") in headers
        server.close()
    uvloop.run(main())


class FakeTransport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed = bytearray(), False

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_framing_fed_byte_by_byte(name):
    """Packet boundaries change nothing: one byte per data_received, same 400 and close."""
    async def main():
        protocol, transport = HTTPProtocol(router(), LIMITS), FakeTransport()
        protocol.connection_made(transport)
        for i in range(len(BAD[name])):
            protocol.data_received(BAD[name][i:i + 1])
        await asyncio.sleep(0.01)
        protocol.connection_lost(None)
        return bytes(transport.written), transport.closed
    written, closed = asyncio.run(main())
    assert written.startswith(b"HTTP/1.1 400 ") and written.count(b"HTTP/1.1") == 1, written
    assert closed
