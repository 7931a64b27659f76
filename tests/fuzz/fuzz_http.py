"""atheris target: pyserve's HTTP protocol (server/http.py HTTPProtocol) fed arbitrary bytes
through a fake transport, in arbitrary pieces, under fuzzer-chosen limits.

Properties, per input: data_received never raises; everything written is a sequence of
well-formed HTTP/1.1 responses (status line, header lines without CR/LF/NUL, a body framed by
Content-Length or valid chunking, none for HEAD), one per request the handler answered, in
order, plus at most one protocol-level refusal (4xx, 'connection: close') last; a
'100 Continue' comes only where the request it precedes asked for it; nothing follows a
'connection: close' response.

    python -m tests.fuzz.fuzz_http -runs=100000 -seed=1 CORPUS_DIR   # libFuzzer flags
(tests/fuzz/test_atheris.py runs it briefly in CI; CORPUS_DIR is seeded by seed_corpus().)"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["pyserve.server.http"]):
    from pyserve.server.http import HTTPLimits
from tests.fuzz.http_wire import App, exchange  # after: instrumented

SEEDS = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"HEAD /h HTTP/1.1\r\n\r\nGET /stream HTTP/1.1\r\n\r\n",
    b"POST /p HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello",
    b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET /a HTTP/1.0\r\n\r\n",
    b"GET /raise HTTP/1.1\r\nConnection: close\r\n\r\n",
    b"POST /p HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
    b"GET /a HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    b"GET /broken HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n",
]


def _limits(head: bytes) -> HTTPLimits:
    """The input's first three bytes: small limits often, so 431 and 413 are reached."""
    return HTTPLimits(max_header_bytes=16 + head[0] * 16, max_headers=1 + head[1] % 64,
                      max_body_bytes=head[2] * 16)


def one_input(data: bytes, loop) -> None:
    if len(data) < 4:
        return
    exchange(data[4:], 1 + data[3] % 8, _limits(data[:3]), App(), loop)


def seed_corpus(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(SEEDS):  # generous limits, one piece; then the same in 3 pieces
        (directory / f"seed-{i}").write_bytes(b"\xff\x3f\xff\x00" + seed)
        (directory / f"seed-{i}-split").write_bytes(b"\xff\x3f\xff\x02" + seed)


def main() -> None:
    logging.disable(logging.CRITICAL)  # the 500 path logs a traceback per input
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    atheris.Setup(sys.argv, lambda data: one_input(data, loop))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
