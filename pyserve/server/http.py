"""HTTP/1.1 on asyncio: one HTTPProtocol per connection, httptools for parsing.

Each httptools callback does one small thing. Parsed requests queue up (pipelining) and are
answered strictly in order by one task per connection. A handler returns a Response, or a
StreamingResponse whose chunks are written as they come; writing a chunk waits while the
transport's buffer is above its high-water mark, so a slow reader pauses only its own stream.
A stream whose chunks raise still ends: with the route's error event and end marker
(StreamingResponse.on_error), the chunked body's end, and the connection closed.
When the peer goes away the running handler is cancelled at once, which is how a request
in the engine gets aborted.

Limits: headers over limits.max_header_bytes or more than limits.max_headers of them -> 431, a
body over limits.max_body_bytes -> 413, malformed HTTP -> 400; each closes the connection.
Timeouts: a request whose headers have not arrived within header_timeout_s, or an idle keep-alive
connection after keepalive_timeout_s, is closed; a body not complete within body_timeout_s of its
headers gets 408 and is closed.

Framing (request smuggling): a message is framed one way only, or refused with 400 and closed.
llhttp runs strict (no leniency flag is ever set) and already refuses Content-Length together
with Transfer-Encoding, a repeated or non-decimal Content-Length, a repeated Transfer-Encoding,
whitespace before a header's colon, CR, LF or other control bytes in names and values, bare LF
line ends, chunk sizes that are not hex or overflow 64 bits and chunk data not followed by CRLF.
On top of it we refuse any Transfer-Encoding but the single coding `chunked`, and one on an
HTTP/1.0 request (RFC 9112 6.1); a chunk size of 2^63 or more (llhttp takes up to 2^64 - 1,
where parsers that hold sizes in a signed 64-bit integer disagree with it) is a 400 at once,
and a chunk that would take the body past its limit a 413 at once, not when its bytes come
(llhttp does not tell a chunk's size: chunked_feed.py reads it). A response header that would
carry CR, LF or NUL is dropped."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

import httptools
import orjson

from pyserve.server.chunked_feed import ChunkedFeed

logger = logging.getLogger("pyserve.http")
_MAX_PIPELINED = 16  # parsed requests waiting on one connection before reading pauses
_MAX_CHUNK_SIZE = 2**63 - 1  # the largest a signed 64-bit size holds
_LENIENCIES = ("lenient_headers", "lenient_chunked_length", "lenient_keep_alive",
               "lenient_transfer_encoding", "lenient_version", "lenient_data_after_close",
               "lenient_optional_lf_after_cr", "lenient_optional_cr_before_lf",
               "lenient_optional_crlf_after_chunk", "lenient_spaces_after_chunk_size")


@dataclass(frozen=True)
class HTTPLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 256  # header lines per request
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 30.0
    keepalive_timeout_s: float = 5.0
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body


@dataclass
class Request:
    method: str
    target: str  # the raw request target (path and query)
    headers: dict[str, str]  # lower-cased names; repeated headers joined with ", "
    body: bytes = b""
    keep_alive: bool = True
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    path_params: dict[str, str] = field(default_factory=dict)  # the router's {name} segment
    # the body's JSON (or the error it is), when the router parsed it before the handler ran
    # (a large body, in a worker thread: server/openai/serving.py preparse_json)
    json: object = None
    # which --api-key the request presented (its place in the list: server/auth.py); None
    # on a server without --api-key
    api_key_index: int | None = None


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "application/json"


@dataclass
class StreamingResponse:
    status: int
    chunks: AsyncIterator[bytes]
    headers: list[tuple[str, str]] = field(default_factory=list)
    content_type: str = "text/event-stream"
    # the route's last words when its chunks raise (a bug of ours mid-stream): its error event
    # and end marker, given the message and how many chunks went out (the next event's sequence
    # number where each chunk is one event); the body ends after them either way
    on_error: Callable[[str, int], bytes] | None = None


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_UNSAFE_IN_HEADER = re.compile(r"[\r\n\0]")


def _header_line(name: str, value: str) -> bytes:
    if _UNSAFE_IN_HEADER.search(name) or _UNSAFE_IN_HEADER.search(value):
        # llhttp refuses these bytes in requests, so this is a bug of ours: never split a response
        logger.error("dropped response header %r: its name or value has CR, LF or NUL", name)
        return b""
    return f"{name}: {value}\r\n".encode("latin-1", "replace")


def _framing_problem(headers: dict[str, str], http_version: str) -> str | None:
    """Why a request's body framing is refused beyond what strict llhttp refuses, or None."""
    coding = headers.get("transfer-encoding")
    if coding is None:
        return None
    if "content-length" in headers:
        return "Content-Length and Transfer-Encoding together"
    if http_version != "1.1":
        return "Transfer-Encoding in an HTTP/1.0 request"
    if coding.strip().lower() != "chunked":  # repeated headers were joined with ", "
        return f"unsupported Transfer-Encoding {coding!r}: only 'chunked' is accepted"
    return None


def _head(status: int, headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [_status_line(status)]
    lines += [_header_line(k, v) for k, v in headers]
    lines.append(b"connection: keep-alive\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n")
    return b"".join(lines)


class _FlowControl:
    """Write readiness of one transport (asyncio's pause_writing / resume_writing)."""

    def __init__(self):
        self._ready = asyncio.Event()
        self._ready.set()

    def pause(self) -> None:
        self._ready.clear()

    def resume(self) -> None:
        self._ready.set()

    async def drain(self) -> None:
        await self._ready.wait()


class HTTPProtocol(asyncio.Protocol):
    def __init__(self, handler: Handler, limits: HTTPLimits = HTTPLimits(),
                 error_body: Callable[[int, str], bytes] | None = None):
        self._handler = handler
        self._limits = limits
        self._error_body = error_body or _json_error
        self._loop = asyncio.get_event_loop()
        self._parser = httptools.HttpRequestParser(self)
        # strict is llhttp's default; said here so that no one turns a leniency on by accident
        self._parser.set_dangerous_leniencies(**{name: False for name in _LENIENCIES})
        self._feeder = ChunkedFeed(self._parser)
        self._transport: asyncio.Transport | None = None
        self._flow = _FlowControl()
        self._queue: deque[Request] = deque()
        self._worker: asyncio.Task | None = None
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None
        self._in_message = False  # a request's bytes have begun and not all arrived
        self._failed: tuple[int, str] | None = None  # a refusal waiting for earlier answers
        # the message being parsed
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._body = bytearray()
        self._current: Request | None = None

    # -- connection ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._arm_timer(self._limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._cancel_timer()
        self._flow.resume()
        for request in self._queue:
            request.disconnected.set()
        if self._current is not None:
            self._current.disconnected.set()
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()

    def pause_writing(self) -> None:
        self._flow.pause()

    def resume_writing(self) -> None:
        self._flow.resume()

    def data_received(self, data: bytes) -> None:
        if self._failed is not None:  # refused: nothing after it is read
            return
        try:
            self._feeder.feed(data, lambda: self._failed is not None or self._closing)
        except httptools.HttpParserUpgrade:
            # llhttp stops at an Upgrade (or CONNECT) request, whose message it has completed:
            # that request is answered as plain HTTP (no protocol switch), once, and the
            # connection then closes, since what follows it is not HTTP
            self._transport.pause_reading()
            if self._queue:
                self._queue[-1].keep_alive = False
            else:
                self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            if not self._closing and self._failed is None:
                self._fail(400, f"malformed HTTP request: {exc}")

    # -- httptools callbacks ---------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._header_bytes, self._body = b"", [], 0, bytearray()
        self._in_message = True
        self._arm_timer(self._limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._count_header_bytes(len(name) + len(value) + 4)
        if len(self._headers) > self._limits.max_headers:
            self._fail(431, f"more than {self._limits.max_headers} request headers")
            raise httptools.HttpParserError("too many headers")

    def on_headers_complete(self) -> None:
        self._cancel_timer()
        headers: dict[str, str] = {}
        for name, value in self._headers:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        problem = _framing_problem(headers, self._parser.get_http_version())
        if problem is not None:
            self._fail(400, f"malformed HTTP request: {problem}")
            raise httptools.HttpParserError(problem)
        length = int(headers.get("content-length", "0").strip())  # llhttp checked its digits
        if length > self._limits.max_body_bytes:
            self._fail(413, f"request body over {self._limits.max_body_bytes} bytes")
            raise httptools.HttpParserError("body too large")
        self._current = Request(self._parser.get_method().decode("latin-1"),
                                self._url.decode("latin-1"), headers,
                                keep_alive=self._parser.should_keep_alive())
        if length or "transfer-encoding" in headers:
            self._arm_timer(self._limits.body_timeout_s, self._body_timed_out)
        self._feeder.bulk_left, self._feeder.chunked = length, "transfer-encoding" in headers
        if headers.get("expect", "").lower() == "100-continue":
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > self._limits.max_body_bytes:
            self._fail(413, f"request body over {self._limits.max_body_bytes} bytes")
            raise httptools.HttpParserError("body too large")

    def on_chunk_header(self) -> None:
        size = self._feeder.last_size()
        if size is None:
            return
        if size > _MAX_CHUNK_SIZE:
            self._fail(400, f"malformed HTTP request: chunk size {size:#x} is 2^63 or more")
            raise httptools.HttpParserError("chunk size too large")
        if len(self._body) + size > self._limits.max_body_bytes:
            self._fail(413, f"request body over {self._limits.max_body_bytes} bytes")
            raise httptools.HttpParserError("body too large")
        self._feeder.bulk_left = size

    def on_message_complete(self) -> None:
        self._feeder.chunked = False
        self._cancel_timer()
        self._in_message = False
        request, self._current = self._current, None
        request.body = bytes(self._body)
        self._queue.append(request)
        if len(self._queue) >= _MAX_PIPELINED and not self._closing:
            self._transport.pause_reading()  # a client pipelining ahead waits for answers
        if self._worker is None or self._worker.done():
            self._worker = self._loop.create_task(self._serve_queue())

    # -- answering -------------------------------------------------------------------------------
    async def _serve_queue(self) -> None:
        while self._queue and not self._closing:
            request = self._queue.popleft()
            if len(self._queue) == _MAX_PIPELINED - 1:
                self._transport.resume_reading()
            try:
                response = await self._handler(request)
            except asyncio.CancelledError:
                return
            except Exception:  # a bug of ours: answer 500, keep the server up
                logger.exception("unhandled error answering %s %s", request.method, request.target)
                response = Response(500, self._error_body(500, "internal server error"))
            keep_alive = request.keep_alive and not self._closing
            if isinstance(response, StreamingResponse):
                keep_alive = await self._write_stream(request, response, keep_alive)
            else:
                self._write_response(request, response, keep_alive)
            if not keep_alive:
                self._close()
                return
        if self._failed is not None and not self._closing:
            self._refuse(*self._failed)
        elif not self._closing and not self._in_message:  # else its header or body timer runs
            self._arm_timer(self._limits.keepalive_timeout_s)

    def _write_response(self, request: Request, response: Response, keep_alive: bool) -> None:
        headers = [("content-type", response.content_type),
                   ("content-length", str(len(response.body))), *response.headers]
        head = _head(response.status, headers, keep_alive)
        self._transport.write(head if request.method == "HEAD" else head + response.body)

    async def _write_stream(self, request: Request, response: StreamingResponse,
                            keep_alive: bool) -> bool:
        headers = [("content-type", response.content_type), ("cache-control", "no-cache"),
                   ("transfer-encoding", "chunked"), *response.headers]
        self._transport.write(_head(response.status, headers, keep_alive))
        if request.method == "HEAD":  # the head alone, as for a plain response
            await _close_iterator(response.chunks)
            return keep_alive
        failed, sent = False, 0
        try:
            async for chunk in response.chunks:
                if self._closing:
                    break
                if chunk:
                    self._write_chunk(chunk)
                    sent += 1
                    await self._flow.drain()
        except Exception:  # a bug of ours: the stream still ends, or its client would hang
            logger.exception("unhandled error streaming %s %s", request.method, request.target)
            failed = True
        finally:
            try:
                await _close_iterator(response.chunks)
            except Exception:
                logger.exception("unhandled error closing the stream of %s %s", request.method,
                                 request.target)
                failed = True
        if self._closing:
            return False
        if failed and response.on_error is not None:
            last_words = response.on_error("internal server error: the response stream failed", sent)
            if last_words:
                self._write_chunk(last_words)
        self._transport.write(b"0\r\n\r\n")
        return keep_alive and not failed  # after a failure the connection is not trusted

    def _write_chunk(self, chunk: bytes) -> None:
        self._transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    # -- failures and timers ---------------------------------------------------------------------
    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._limits.max_header_bytes:
            self._fail(431, f"request headers over {self._limits.max_header_bytes} bytes")
            raise httptools.HttpParserError("headers too large")

    def _body_timed_out(self) -> None:
        self._fail(408, f"the request body did not arrive within {self._limits.body_timeout_s:g}s")

    def _fail(self, status: int, message: str) -> None:
        """Answers a protocol-level error and closes the connection. Answers go out in order:
        while earlier pipelined requests are being answered, this one waits for them and
        nothing more is read."""
        if self._closing or self._transport is None or self._failed is not None:
            return
        if self._worker is not None and not self._worker.done():
            self._failed = (status, message)
            self._cancel_timer()
            self._transport.pause_reading()
            return
        self._refuse(status, message)

    def _refuse(self, status: int, message: str) -> None:
        body = self._error_body(status, message)
        headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
        self._transport.write(_head(status, headers, keep_alive=False) + body)
        self._close()

    def _close(self) -> None:
        self._closing = True
        self._cancel_timer()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _arm_timer(self, seconds: float, on_expiry: Callable[[], None] | None = None) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(seconds, on_expiry or self._close)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _json_error(status: int, message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": HTTPStatus(status).phrase,
                                   "param": None, "code": status}})


async def _close_iterator(chunks) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
