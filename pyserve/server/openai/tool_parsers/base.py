"""The tool-parser interface and the streaming machinery every format shares.

A parser is a state machine over the model's text. `_mode` is the handler of the current state:
`handler(text, pos, final) -> new pos`; it consumes what it can, may switch `_mode`, and the
driver stops when a handler neither consumes nor switches. Whatever a handler leaves unconsumed
(at most a possible marker's length) is kept for the next feed, so each character is looked at a
bounded number of times and any way of splitting the text gives the same result.

Content, the text outside calls, obeys one rule in both paths: the whitespace around a call is
dropped, except that text on both sides of calls stays joined by the whitespace that came before
the first of them ("Checking.\n<call>\n<call>\nDone" -> "Checking.\nDone"), and content that is
only whitespace is no content. Output without calls is content unchanged. So trailing whitespace
is held until non-space text follows, and leading whitespace until something non-space is written.

extract() runs a fresh parser over the whole text and reads the calls back, so it agrees with
streaming by construction. A malformed call (Malformed from a handler) makes extract() return no
calls and the whole text as content, as vLLM does; a stream, which cannot take back what it has
sent, releases the call's raw text as content when its header has not gone out yet (so a
malformed first call streams exactly what extract() returns), and from then on passes all text
through as content.
"""

import re
import secrets
from dataclasses import dataclass, field

from .json_stream import CallObject, Malformed

__all__ = ["ToolCall", "ExtractedToolCalls", "ToolParser", "make_tool_call_id"]

_WS = " \t\n\r"


def make_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as a string (OpenAI's function.arguments)
    id: str = field(default_factory=make_tool_call_id)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # text outside the calls (None if empty/whitespace only)


def skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in _WS:
        pos += 1
    return pos


class MarkerSearch:
    """The earliest of several markers from a position, and how much of a text's end could be the
    start of one (to be held back until the next piece decides)."""

    def __init__(self, markers: tuple[str, ...]):
        self.markers = markers
        self._re = re.compile("|".join(map(re.escape, markers))) if markers else None
        self._prefixes = {m[:k] for m in markers for k in range(1, len(m))}
        self._longest = max((len(m) for m in markers), default=1) - 1

    def find(self, text: str, pos: int) -> tuple[int, str] | None:
        m = self._re.search(text, pos) if self._re else None
        return (m.start(), m.group()) if m else None

    def safe_end(self, text: str, pos: int) -> int:
        n = len(text)
        for k in range(min(self._longest, n - pos), 0, -1):
            if text[n - k:] in self._prefixes:
                return n - k
        return n


class _Call:
    __slots__ = ("id", "name", "parts")

    def __init__(self, name: str):
        self.id, self.name, self.parts = make_tool_call_id(), name, []


class ToolParser:
    """tools: the request's OpenAI tools list (names, schemas), may be None."""

    START_MARKERS: tuple[str, ...] = ()  # what opens a call inside content

    def __init__(self, tools: list[dict] | None = None):
        self.tools = list(tools or [])
        self._markers = MarkerSearch(self.START_MARKERS)
        self._mode = self._start
        self._pending = ""  # text not consumed yet
        self._fed = 0  # characters fed so far
        self._base = 0  # absolute offset of the text being advanced over
        self._seen: list[str] = []  # everything fed, for releasing a malformed call's raw text
        self._frags: list[list] = []  # ["c", parts] | ["h", index] | ["a", index, parts]
        self._calls: list[_Call] = []
        self._call_start = 0  # absolute offset of the current call's marker
        self._header_sent = True
        self._pre_ws = ""  # whitespace held before the current call's marker
        self._ws: list[str] = []  # trailing whitespace of content, not written yet
        self._ws_before_call = False  # ...and it came before a call (dropped at the end)
        self._nonws = False  # some non-space content has been written
        self._after_call = False  # drop whitespace until content resumes
        self._failed = False

    # -- the interface --------------------------------------------------------------------------

    def extract(self, text: str) -> ExtractedToolCalls:
        parser = type(self)(self.tools)
        parser._feed(text)
        parser._finish()
        if parser._failed:
            return ExtractedToolCalls(False, [], text)
        content = "".join(part for f in parser._frags if f[0] == "c" for part in f[1])
        calls = [ToolCall(c.name, "".join(c.parts), c.id) for c in parser._calls]
        return ExtractedToolCalls(bool(calls), calls, content or None)

    def feed(self, delta: str) -> list[dict]:
        """The next piece of the output -> OpenAI delta fragments (content or tool_calls)."""
        self._feed(delta)
        return self._take()

    def finish(self) -> list[dict]:
        """End of the output: whatever was held back."""
        self._finish()
        return self._take()

    def _feed(self, delta: str):
        if delta:
            self._seen.append(delta)
            self._fed += len(delta)
            text = self._pending + delta
            self._pending = text[self._advance(text, False):]

    def _finish(self):
        text, self._pending = self._pending, ""
        self._advance(text, True)
        if self._ws and self._nonws and not self._ws_before_call:
            self._emit_content("".join(self._ws))
        self._ws = []

    # -- the driver -----------------------------------------------------------------------------

    def _advance(self, text: str, final: bool) -> int:
        self._base = self._fed - len(text)
        pos = 0
        while True:
            mode = self._mode
            try:
                new = mode(text, pos, final)
            except Malformed as e:
                self._fail(e.pos)
                new = e.pos
            if new == pos and self._mode is mode:
                return pos
            pos = new

    def _start(self, text: str, pos: int, final: bool) -> int:
        """The first state; formats whose calls may open the output without a marker override it."""
        self._mode = self._content
        return pos

    def _content(self, text: str, pos: int, final: bool) -> int:
        found = self._markers.find(text, pos)
        if found:
            i, marker = found
            self._text(text[pos:i])
            self._begin_call(i)
            self._mode = self._open(marker)
            return i + len(marker)
        end = len(text) if final else self._markers.safe_end(text, pos)
        self._text(text[pos:end])
        return end

    def _open(self, marker: str):
        """The handler that reads a call opened by `marker`."""
        raise NotImplementedError

    def _passthrough(self, text: str, pos: int, final: bool) -> int:
        self._text(text[pos:])
        return len(text)

    # -- what handlers call ---------------------------------------------------------------------

    def _call_object(self, then):
        """A handler reading one `{"name", "arguments"}` call object (json_stream.CallObject),
        streaming its header and arguments as they come, then handing over to `then`."""
        obj = CallObject(self._header, self._args)

        def read(text: str, pos: int, final: bool) -> int:
            pos = obj.feed(text, pos, final)
            if obj.done:
                self._mode = then
            elif final:
                raise Malformed(pos, "unfinished call")
            return pos

        return read

    def _begin_call(self, i: int):
        """A call starts at text index i (its marker, or its first character)."""
        self._pre_ws = "".join(self._ws)
        if self._nonws and self._pre_ws:  # kept in case text resumes after the call
            self._ws, self._ws_before_call = [self._pre_ws], True
        else:
            self._ws = []
        self._call_start = self._base + i
        self._header_sent = False

    def _header(self, name: str):
        self._calls.append(_Call(name))
        self._frags.append(["h", len(self._calls) - 1])
        self._header_sent = True
        self._pre_ws = ""

    def _args(self, s: str):
        if not s:
            return
        index = len(self._calls) - 1
        self._calls[index].parts.append(s)
        last = self._frags[-1] if self._frags else None
        if last and last[0] == "a" and last[1] == index:
            last[2].append(s)
        else:
            self._frags.append(["a", index, [s]])

    def _end_call(self):
        self._after_call = True
        self._mode = self._content

    def _fail(self, pos: int):
        self._failed = True
        if not self._header_sent:
            raw = "".join(self._seen)[self._call_start:self._base + pos]
            self._header_sent = True
            self._after_call = self._ws_before_call = False
            self._ws = []
            self._text(self._pre_ws + raw)
        self._pre_ws = ""
        self._after_call = False
        self._mode = self._passthrough

    def _text(self, s: str):
        """Content, under the whitespace rule of the module docstring."""
        if not s:
            return
        if self._after_call:
            s = s.lstrip(_WS)
            if not s:
                return
            self._after_call = False
        body = s.rstrip(_WS)
        if body:
            if self._ws:
                self._emit_content("".join(self._ws))
                self._ws = []
            self._emit_content(body)
            self._nonws, self._ws_before_call = True, False
        if len(body) < len(s):
            self._ws.append(s[len(body):])

    def _emit_content(self, s: str):
        last = self._frags[-1] if self._frags else None
        if last and last[0] == "c":
            last[1].append(s)
        else:
            self._frags.append(["c", [s]])

    def _take(self) -> list[dict]:
        out = []
        for f in self._frags:
            if f[0] == "c":
                out.append({"content": "".join(f[1])})
            elif f[0] == "h":
                call = self._calls[f[1]]
                out.append({"tool_calls": [{"index": f[1], "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": f[1],
                                            "function": {"arguments": "".join(f[2])}}]})
        self._frags = []
        return out
