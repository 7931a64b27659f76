"""Feeding llhttp so that a chunk's size is known: llhttp parses a chunk-size line but does not
say the size, and its callbacks carry no offsets into the bytes fed. HTTPProtocol reads the
size in on_chunk_header from the line this feeder fed last (server/http.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("pyserve.http")
_MAX_LINE_KEPT = 64 * 1024  # of a line fed, the bytes kept to read a size from


class ChunkedFeed:
    """Feeds llhttp in pieces cut where its state is known, so that when llhttp calls
    on_chunk_header the chunk-size line it accepted is the last line fed:
      * a header block in one piece, to the end of its blank line (the first CRLF CRLF: llhttp
        refuses CR and LF anywhere else in a head, and a blank line split between two reads is
        found from the bytes kept of the first);
      * a Content-Length body, or a chunk's data, in one piece of its known length;
      * the rest of a chunked body (size lines, the CRLF after data, trailers) line by line,
        each piece ending with LF, so a chunk header completes exactly at a piece's end.
    The owner says what comes next: bulk_left (body or chunk bytes) and chunked (inside a
    chunked body), set from llhttp's callbacks. How bytes are cut never changes what llhttp
    parses; it stays the only judge of framing, and only lines it accepted are read here."""

    def __init__(self, parser):
        self._parser = parser
        self._line = bytearray()  # the chunked-body line being fed, to the last LF fed
        self._tail = b""  # the last bytes of a head not yet ended: a blank line may straddle
        self.bulk_left = 0  # bytes of a body or a chunk's data to feed in one piece
        self.chunked = False  # inside a chunked body (after its head, before its end)

    def feed(self, data: bytes, stopped: Callable[[], bool]) -> None:
        view, pos, end = memoryview(data), 0, len(data)
        while pos < end and not stopped():
            if self.bulk_left:
                cut = min(end, pos + self.bulk_left)
                self.bulk_left -= cut - pos
            elif self.chunked:
                lf = data.find(b"\n", pos)
                cut = end if lf < 0 else lf + 1
                if len(self._line) < _MAX_LINE_KEPT:  # the size leads; a long extension is not kept
                    self._line += view[pos:min(cut, pos + _MAX_LINE_KEPT)]
            else:
                cut = self._end_of_head(data, pos, end)
            self._parser.feed_data(view[pos:cut])
            if self._line.endswith(b"\n"):
                self._line.clear()
            pos = cut

    def _end_of_head(self, data: bytes, pos: int, end: int) -> int:
        """Just past the blank line that ends the head being fed, or end if it is not in data."""
        tail, self._tail = self._tail, b""
        if tail:
            found = (tail + data[pos:pos + 3]).find(b"\r\n\r\n")
            if found >= 0:
                return pos + found + 4 - len(tail)
        found = data.find(b"\r\n\r\n", pos)
        if found >= 0:
            return found + 4
        self._tail = (tail + data[pos:end])[-3:]
        return end

    def last_size(self) -> int | None:
        """The size on the chunk-size line just accepted (hex, before any extension)."""
        try:
            return int(bytes(self._line).split(b";", 1)[0].strip(), 16)
        except ValueError:  # not a size line: a bug of ours; llhttp alone judges the framing
            logger.error("no chunk size in %r", bytes(self._line[:64]))
            return None
