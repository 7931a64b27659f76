"""The wire side of fuzzing server/http.py: a fake transport recording what HTTPProtocol
writes, a handler that answers by target, and a strict reader of the responses written
(tests/fuzz/fuzz_http.py states the properties it checks)."""

from __future__ import annotations

import asyncio
import re

from pyserve.server.http import HTTPProtocol, Response, StreamingResponse


class FakeTransport(asyncio.Transport):
    """What HTTPProtocol calls on its transport, recorded."""

    def __init__(self):
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.paused = False

    def write(self, data) -> None:
        assert not self.closed, "write after close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name, default=None):
        return default


class CountingProtocol(HTTPProtocol):
    """The real protocol, counting the requests whose parsing began (a refusal must be of one
    of them that the handler never saw)."""

    begun = 0

    def on_message_begin(self) -> None:
        self.begun += 1
        super().on_message_begin()


# what App's broken stream says last (StreamingResponse.on_error)
LAST_WORDS = b'data: {"error": "stream failed"}\n\ndata: [DONE]\n\n'


class App:
    """Answers by target: '/stream' streams two chunks, '/broken' one chunk and then raises (a
    bug mid-stream), '/raise' raises (the 500 path), others echo; records each request it
    answered, in order."""

    def __init__(self):
        self.answered: list = []

    async def __call__(self, request):
        self.answered.append(request)
        if "raise" in request.target:
            raise RuntimeError("a handler bug")
        if "broken" in request.target:
            async def broken():
                yield b"data: 1\n\n"
                raise TypeError("str is not valid UTF-8: surrogates not allowed")
            return StreamingResponse(200, broken(), on_error=lambda message, sent: LAST_WORDS)
        if "stream" in request.target:  # HEAD too, though no route streams to one yet
            async def chunks():
                yield b"data: 1\n\n"
                yield b""
                yield b"data: 2\n\n"
            return StreamingResponse(200, chunks(), headers=[("x-a", "1")])
        return Response(200, b'{"n": %d}' % len(request.body), headers=[("x-t", request.target)])


_STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9]{2}) [^\r\n]*")
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+): ([^\r\n\0]*)")


class Malformed(AssertionError):
    pass


def _chunked(data: bytes, at: int) -> int:
    """The offset past a chunked body starting at `at`."""
    while True:
        end = data.find(b"\r\n", at)
        if end < 0 or not re.fullmatch(rb"[0-9a-f]+", data[at:end]):
            raise Malformed(f"bad chunk size at {at}: {data[at:at + 20]!r}")
        size = int(data[at:end], 16)
        at = end + 2
        if size == 0:
            if data[at:at + 2] != b"\r\n":
                raise Malformed("no CRLF after the last chunk")
            return at + 2
        if size == 0 or data[at + size:at + size + 2] != b"\r\n":
            raise Malformed("chunk data not followed by CRLF")
        at += size + 2


def parse_responses(data: bytes, methods: list[str]) -> list[tuple[int, dict]]:
    """(status, headers) of each response in data; methods: the requests' methods in order
    (a HEAD's answer has no body), answered ones first."""
    out, at, finals = [], 0, 0
    while at < len(data):
        end = data.find(b"\r\n\r\n", at)
        if end < 0:
            raise Malformed(f"a response head never ends: {data[at:at + 80]!r}")
        lines = data[at:end].split(b"\r\n")
        match = _STATUS_LINE.fullmatch(lines[0])
        if match is None:
            raise Malformed(f"bad status line {lines[0]!r}")
        headers = {}
        for line in lines[1:]:
            header = _HEADER_LINE.fullmatch(line)
            if header is None:
                raise Malformed(f"bad header line {line!r}")
            headers[header[1].decode().lower()] = header[2].decode("latin-1")
        status, at = int(match[1]), end + 4
        out.append((status, headers))
        if status < 200:
            continue
        head_request = finals < len(methods) and methods[finals] == "HEAD"
        finals += 1
        if headers.get("transfer-encoding") == "chunked":
            if "content-length" in headers:
                raise Malformed("both Content-Length and chunked")
            at = at if head_request else _chunked(data, at)
        elif "content-length" in headers:
            if not re.fullmatch(r"[0-9]+", headers["content-length"]):
                raise Malformed("bad Content-Length")
            length = 0 if head_request else int(headers["content-length"])
            if at + length > len(data):
                raise Malformed("a body shorter than its Content-Length")
            at += length
        else:
            raise Malformed(f"a {status} response without framing")
    return out


def check(written: bytes, app: App, begun: int) -> None:
    methods = [r.method for r in app.answered]
    responses = parse_responses(written, methods)
    finals = [(s, h) for s, h in responses if s >= 200]
    if len(finals) not in (len(methods), len(methods) + 1):
        raise Malformed(f"{len(finals)} responses for {len(methods)} answered requests")
    if len(finals) == len(methods) + 1:  # a refusal of a request the handler never saw
        if begun <= len(methods):
            raise Malformed(f"a refusal after answering all {begun} requests begun")
        status, headers = finals[-1]
        if not 400 <= status < 500 or headers.get("connection") != "close":
            raise Malformed(f"a refusal {status} {headers}")
    for status, headers in finals[:-1]:
        if headers.get("connection") == "close":
            raise Malformed("a response after 'connection: close'")
    final = 0
    for status, _ in responses:  # a 100 Continue belongs to the next final response's request
        if status == 100:
            asked = (final < len(methods)
                     and app.answered[final].headers.get("expect", "").lower() == "100-continue")
            if not asked and final < len(methods):
                raise Malformed(f"a 100 Continue before the answer to request {final}, which "
                                "did not ask for one")
        else:
            final += 1


def _settle(loop) -> None:
    async def settle():
        for _ in range(8):  # the worker's answer, a stream's chunks and its close
            await asyncio.sleep(0)
    loop.run_until_complete(settle())


def exchange(stream: bytes, pieces: int, limits, app: App, loop) -> FakeTransport:
    """stream sent to a fresh protocol in `pieces` pieces, as asyncio would deliver it (no
    more once the transport is closed or paused), the answers checked; the transport returned."""
    transport = FakeTransport()
    protocol = CountingProtocol(app, limits)
    protocol.connection_made(transport)
    size = max(1, len(stream) // pieces)
    for at in range(0, len(stream), size):
        _settle(loop)
        if transport.closed or transport.paused:
            break
        protocol.data_received(stream[at:at + size])  # must not raise
    _settle(loop)
    protocol.connection_lost(None)
    _settle(loop)
    check(bytes(transport.written), app, protocol.begun)
    return transport
