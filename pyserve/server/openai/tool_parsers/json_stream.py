"""Incremental JSON: raw text in, canonical text out as soon as it can no longer change.

Canonical form is what `json.dumps(json.loads(raw), ensure_ascii=False)` writes: separators ", "
and ": ", no other whitespace, strings re-escaped as json.dumps escapes them, numbers normalised
through json (1.50 -> 1.5, 1E2 -> 100.0). It is produced token by token, so the output so far is
always a prefix of the final text and does not depend on how the input was split: structural
characters and string characters are emitted as they are read, a number or literal once the
character after it is seen, a \\uXXXX high surrogate once it is known whether a low one follows.
Every state consumes all input it is given (a scalar or escape in progress is kept inside), so
feeding text in any pieces costs time linear in its length; there is no recursion, so nesting
depth costs only a list entry.

Two differences from json.loads, shared by streaming and extract() alike: raw control characters
inside strings are accepted (strict=False) and re-escaped, and a key repeated in one object is
kept twice where json.loads would keep the last value at the first key's position.

And two from json.dumps, so that strict parsers read the output (server/strict_json.py): a \\u
escape of a lone surrogate is written U+FFFD (a pair is joined into its character, as json.loads
joins it), and NaN, Infinity, -Infinity and numbers beyond a double's range (1e999) are null.
"""

import json
import re

__all__ = ["Malformed", "JsonStream", "CallObject", "canonical_json", "escape"]


class Malformed(Exception):
    """The text cannot be a well-formed tool call; `pos` indexes the text being fed where it was seen."""

    def __init__(self, pos: int, why: str = "malformed"):
        super().__init__(f"{why} at {pos}")
        self.pos = pos


_WS = frozenset(" \t\n\r")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')
_SCALAR = re.compile(r"[0-9A-Za-z+\-.]+")
_SCALAR_START = frozenset("-0123456789tfnNI")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_LITERALS = frozenset(("true", "false", "null"))
# Python's json reads these and writes them back; JSON has no such numbers
_NON_FINITE = frozenset(("NaN", "Infinity", "-Infinity"))
_REPLACEMENT = "\ufffd"  # what a lone surrogate escape becomes
_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "/", "b": "\\b", "f": "\\f", "n": "\\n", "r": "\\r",
            "t": "\\t"}
_HEX = re.compile(r"[0-9a-fA-F]*")

(_VALUE, _ARR_FIRST, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _STRING, _ESCAPE, _UNICODE,
 _SURR_BS, _SURR_U, _SCALAR_ST, _DONE) = range(13)


def escape(s: str) -> str:
    """The inside of json.dumps(s, ensure_ascii=False): per character, so it composes over pieces."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


class JsonStream:
    """One JSON value. feed() consumes text from pos and returns where it stopped (the end of the
    text, or just past the value); canonical output collects in `out` (take() drains it)."""

    __slots__ = ("out", "done", "_state", "_stack", "_key", "_tok", "_hex", "_high")

    def __init__(self):
        self.out: list[str] = []
        self.done = False
        self._state = _VALUE
        self._stack: list[str] = []  # closing characters of the open containers
        self._key = False  # the string being read is an object key
        self._tok: list[str] = []  # number or literal so far
        self._hex = ""  # digits of a \uXXXX escape so far
        self._high = 0  # a high surrogate waiting to see whether a low one follows

    def take(self) -> str:
        s = "".join(self.out)
        self.out.clear()
        return s

    def feed(self, text: str, pos: int, final: bool = False) -> int:
        out, n = self.out, len(text)
        while pos < n and not self.done:
            st = self._state
            if st == _STRING:
                m = _PLAIN.match(text, pos)
                if m:
                    out.append(m.group())
                    pos = m.end()
                    continue
                c = text[pos]
                pos += 1
                if c == '"':
                    out.append('"')
                    self._end_string()
                elif c == "\\":
                    self._state = _ESCAPE
                else:  # a raw control character: accepted, written escaped
                    out.append(escape(c))
            elif st == _ESCAPE:
                c = text[pos]
                if c == "u":
                    self._state, self._hex = _UNICODE, ""
                elif c in _ESCAPES:
                    out.append(_ESCAPES[c])
                    self._state = _STRING
                else:
                    raise Malformed(pos, "bad escape")
                pos += 1
            elif st == _UNICODE:
                digits = _HEX.match(text, pos, min(n, pos + 4 - len(self._hex))).group()
                self._hex += digits
                pos += len(digits)
                if len(self._hex) == 4:
                    self._code_unit(int(self._hex, 16))
                elif pos < n:
                    raise Malformed(pos, "bad \\u escape")
            elif st == _SURR_BS:
                if text[pos] == "\\":
                    self._state = _SURR_U
                    pos += 1
                else:
                    self._flush_high(_STRING)
            elif st == _SURR_U:
                if text[pos] == "u":
                    self._state, self._hex = _UNICODE, ""
                    pos += 1
                else:  # the backslash began some other escape
                    self._flush_high(_ESCAPE)
            elif st == _SCALAR_ST:
                m = _SCALAR.match(text, pos)
                if m:
                    self._tok.append(m.group())
                    pos = m.end()
                if pos < n:
                    self._end_scalar(pos)
            else:
                c = text[pos]
                if c in _WS:
                    pos += 1
                else:
                    pos = self._structural(c, pos)
        if final and self._state == _SCALAR_ST and not self._stack:
            self._end_scalar(pos)
        return pos

    def _structural(self, c: str, pos: int) -> int:
        st, out = self._state, self.out
        if st == _VALUE or st == _ARR_FIRST:
            if c == "]" and st == _ARR_FIRST:
                return self._close(pos)
            if c == "{":
                out.append("{")
                self._stack.append("}")
                self._state = _OBJ_FIRST
            elif c == "[":
                out.append("[")
                self._stack.append("]")
                self._state = _ARR_FIRST
            elif c == '"':
                out.append('"')
                self._key, self._state = False, _STRING
            elif c in _SCALAR_START:
                self._state = _SCALAR_ST
                return pos
            else:
                raise Malformed(pos, "expected a value")
            return pos + 1
        if st == _OBJ_FIRST or st == _OBJ_KEY:
            if c == "}" and st == _OBJ_FIRST:
                return self._close(pos)
            if c != '"':
                raise Malformed(pos, "expected a key")
            out.append('"')
            self._key, self._state = True, _STRING
            return pos + 1
        if st == _COLON:
            if c != ":":
                raise Malformed(pos, "expected ':'")
            out.append(": ")
            self._state = _VALUE
            return pos + 1
        # _AFTER: a value inside a container has ended
        if c == ",":
            out.append(", ")
            self._state = _OBJ_KEY if self._stack[-1] == "}" else _VALUE
            return pos + 1
        if c == self._stack[-1]:
            return self._close(pos)
        raise Malformed(pos, "expected ',' or a closing bracket")

    def _close(self, pos: int) -> int:
        self.out.append(self._stack.pop())
        self._value_end()
        return pos + 1

    def _value_end(self):
        if self._stack:
            self._state = _AFTER
        else:
            self.done, self._state = True, _DONE

    def _end_string(self):
        if self._key:
            self._key, self._state = False, _COLON
        else:
            self._value_end()

    def _end_scalar(self, pos: int):
        tok = "".join(self._tok)
        self._tok.clear()
        if tok in _LITERALS:
            canon = tok
        elif tok in _NON_FINITE:
            canon = "null"
        elif _NUMBER.match(tok):
            try:
                canon = json.dumps(json.loads(tok))
            except ValueError:  # e.g. past Python's int digit limit
                raise Malformed(pos, "bad number") from None
            if canon in _NON_FINITE:  # 1e999: beyond a double's range
                canon = "null"
        else:
            raise Malformed(pos, "bad literal")
        self.out.append(canon)
        self._value_end()

    def _code_unit(self, code: int):
        # json.loads pairs a high surrogate with an immediately following \u low surrogate and
        # otherwise keeps each unit alone (which has no UTF-8 form: written U+FFFD here); the
        # second unit is then read afresh.
        if self._high:
            if 0xDC00 <= code <= 0xDFFF:
                self.out.append(chr(0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)))
                self._high, self._state = 0, _STRING
                return
            self.out.append(_REPLACEMENT)
            self._high = 0
        if 0xD800 <= code <= 0xDBFF:
            self._high, self._state = code, _SURR_BS
        else:
            self.out.append(_REPLACEMENT if 0xDC00 <= code <= 0xDFFF else escape(chr(code)))
            self._state = _STRING

    def _flush_high(self, state: int):
        """The high surrogate held had no low one after it."""
        self.out.append(_REPLACEMENT)
        self._high, self._state = 0, state


def canonical_json(text: str) -> str | None:
    """The canonical form of a complete JSON value (surrounding whitespace allowed), else None."""
    js = JsonStream()
    try:
        pos = js.feed(text, 0, True)
    except Malformed:
        return None
    if not js.done or text[pos:].strip(" \t\n\r"):
        return None
    return js.take()


(_O_START, _O_KEY_FIRST, _O_KEY, _O_COLON, _O_VALUE, _O_AFTER, _O_SUB) = range(7)
_ARG_KEYS = ("arguments", "parameters")


class CallObject:
    """One tool call written as a JSON object, `{"name": "...", "arguments"|"parameters": ...}`,
    other keys ignored. header(name) is called as soon as the name's string closes; the
    arguments go to args() in canonical form as they are read (held until the name is known when
    they come first). Arguments that are a JSON string holding JSON are that JSON, canonical
    (any other string stays the JSON string); null or missing arguments are "{}". Raises
    Malformed without a name, with two names, or with both "arguments" and "parameters"."""

    __slots__ = ("done", "_header", "_args", "_state", "_sub", "_role", "_parts", "_name",
                 "_has_args", "_kind", "_held")

    def __init__(self, header, args):
        self.done = False
        self._header, self._args = header, args
        self._state = _O_START
        self._sub: JsonStream | None = None
        self._role = ""  # what the value being read is: key, name, args or skip
        self._parts: list[str] = []  # canonical text of the key or name being read
        self._name: str | None = None
        self._has_args = False
        self._kind = ""  # first character of the arguments' canonical text
        self._held: list[str] = []  # arguments text not yet passed on

    def feed(self, text: str, pos: int, final: bool = False) -> int:
        n = len(text)
        while pos < n and not self.done:
            st = self._state
            if st == _O_SUB:
                pos = self._sub.feed(text, pos, final)
                self._drain()
                if self._sub.done:
                    self._sub_done(pos)
                continue
            c = text[pos]
            if c in _WS:
                pos += 1
            elif st == _O_START:
                if c != "{":
                    raise Malformed(pos, "expected '{'")
                self._state = _O_KEY_FIRST
                pos += 1
            elif st == _O_KEY_FIRST and c == "}":
                pos = self._close(pos)
            elif st == _O_KEY_FIRST or st == _O_KEY:
                if c != '"':
                    raise Malformed(pos, "expected a key")
                self._start("key")
            elif st == _O_COLON:
                if c != ":":
                    raise Malformed(pos, "expected ':'")
                self._state = _O_VALUE
                pos += 1
            elif st == _O_VALUE:
                key = self._parts and json.loads("".join(self._parts))
                if key == "name":
                    self._start("name")
                elif key in _ARG_KEYS:
                    if self._has_args:
                        raise Malformed(pos, "arguments given twice")
                    self._has_args = True
                    self._start("args")
                else:
                    self._start("skip")
            elif c == ",":  # _O_AFTER
                self._state = _O_KEY
                pos += 1
            elif c == "}":
                pos = self._close(pos)
            else:
                raise Malformed(pos, "expected ',' or '}'")
        return pos

    def _start(self, role: str):
        self._sub, self._role, self._state = JsonStream(), role, _O_SUB
        self._parts = []

    def _drain(self):
        piece = self._sub.take()
        if not piece:
            return
        if self._role == "args":
            if not self._kind:
                self._kind = piece[0]
            if self._kind in ("{", "[") and self._name is not None:
                self._args(piece)
            else:
                self._held.append(piece)
        elif self._role != "skip":
            self._parts.append(piece)

    def _sub_done(self, pos: int):
        role = self._role
        self._state = _O_COLON if role == "key" else _O_AFTER
        if role == "name":
            name = json.loads("".join(self._parts))
            if not isinstance(name, str) or not name.strip() or self._name is not None:
                raise Malformed(pos, "bad name")
            self._name = name
            self._header(name)
            self._release()
        elif role == "args":
            if self._kind not in ("{", "["):
                self._held = [_scalar_arguments("".join(self._held))]
            if self._name is not None:
                self._release()

    def _release(self):
        if self._held:
            self._args("".join(self._held))
            self._held = []

    def _close(self, pos: int) -> int:
        if self._name is None:
            raise Malformed(pos, "no name")
        if not self._has_args:
            self._args("{}")
        self.done = True
        return pos + 1


def _scalar_arguments(canon: str) -> str:
    """Arguments that are not an object or a list: null is none; a string holding JSON is that
    JSON; any other string stays the JSON string it is (as vLLM writes it), so the arguments are
    always JSON."""
    if canon == "null":
        return "{}"
    if canon.startswith('"'):
        return canonical_json(json.loads(canon)) or canon
    return canon
