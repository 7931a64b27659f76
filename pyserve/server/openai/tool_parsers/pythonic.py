"""pythonic: Llama 3.2/4 and ToolACE style — a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), f(x=[1, 2], opts={"a": (1, 2)})]`, optionally wrapped in
`<|python_start|>` ... `<|python_end|>`.

The list must open the output (after whitespace) or follow `<|python_start|>`; text after it is
content. Nothing is ever evaluated: the structure (names, keywords, commas, brackets) is scanned
here, tracking Python string literals (' " ''' \"\"\", backslash escapes), and each argument value
is converted by ast.literal_eval alone, once its end is seen, then written as JSON that strict
parsers read (server/strict_json.py: `1e999` null, an escaped lone surrogate U+FFFD). So
arguments stream a value at a time: `{"city": ` as soon as `city=` is read, the value once the
comma or parenthesis after it arrives. Positional arguments, names that are not identifiers, or
values literal_eval or JSON refuse (calls, f-strings, sets, bytes) make the output malformed.
"""

import ast
import json
import re

from pyserve.server.strict_json import json_text

from .base import ToolParser, skip_ws
from .json_stream import Malformed

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_NAME_PAREN = re.compile(r"([A-Za-z_][\w.]*)[ \t\r\n]*\(")  # the whole head at once, when it is all here
_KEYWORD_EQUALS = re.compile(r"([A-Za-z_]\w*)[ \t\r\n]*=")
_NAME_MORE = re.compile(r"[\w.]+")
_KEYWORD = re.compile(r"[A-Za-z_]\w*")
_KEYWORD_MORE = re.compile(r"\w+")
_CODE = re.compile(r"""[^'"()\[\]{},]+""")  # outside strings: nothing that matters here
_IN_STRING = re.compile(r"""[^'"\\]+""")
# a number that reads the same in Python and JSON
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_CONSTANTS = {"True": "true", "False": "false", "None": "null"}


class _Value:
    """The raw text of one argument value, up to the `,` or `)` that ends it at bracket depth 0."""

    __slots__ = ("parts", "depth", "quote", "escape", "end")

    def __init__(self):
        self.parts: list[str] = []
        self.depth = 0
        self.quote = ""  # the open string's delimiter
        self.escape = False
        self.end = ""  # "," or ")" once the value has ended

    def feed(self, text: str, pos: int, final: bool) -> int:
        start, n = pos, len(text)
        while pos < n and not self.end:
            if self.quote:
                if self.escape:
                    self.escape = False
                    pos += 1
                    continue
                m = _IN_STRING.match(text, pos)
                if m:
                    pos = m.end()
                    continue
                c = text[pos]
                if c == "\\":
                    self.escape = True
                    pos += 1
                elif len(self.quote) == 1:
                    if c == self.quote:
                        self.quote = ""
                    pos += 1
                elif text.startswith(self.quote, pos):
                    self.quote = ""
                    pos += 3
                elif not final and self.quote.startswith(text[pos:]):
                    break  # may be the closing triple quote
                else:
                    pos += 1
                continue
            m = _CODE.match(text, pos)
            if m:
                pos = m.end()
                continue
            c = text[pos]
            if c in "'\"":
                if text.startswith(c * 3, pos):
                    self.quote = c * 3
                    pos += 3
                elif not final and n - pos < 3 and text[pos:] == c * (n - pos):
                    break  # an empty string or a triple quote: the next character decides
                else:
                    self.quote = c
                    pos += 1
            elif c in "([{":
                self.depth += 1
                pos += 1
            elif self.depth:  # a closing bracket or a comma inside one
                self.depth -= c != ","
                pos += 1
            elif c == "," or c == ")":
                self.end = c
            else:
                raise Malformed(pos, "unbalanced brackets")
        self.parts.append(text[start:pos])
        return pos

    def json(self, pos: int) -> str:
        raw = "".join(self.parts).strip()
        if raw in _CONSTANTS:  # the common scalars, without compiling anything
            return _CONSTANTS[raw]
        try:
            value = json.loads(raw) if _NUMBER.match(raw) else ast.literal_eval(raw)
            return json_text(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise Malformed(pos, "not a literal") from None


class PythonicToolParser(ToolParser):
    START_MARKERS = (START,)

    def _start(self, text: str, pos: int, final: bool) -> int:
        i = skip_ws(text, pos)
        self._text(text[pos:i])
        if i < len(text):
            if text[i] == "[":
                self._begin_call(i)
                self._mode = self._call_name
                return i + 1
            self._mode = self._content
        return i

    def _open(self, marker: str):
        return self._list_open

    def _list_open(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] != "[":
                raise Malformed(pos, "expected '['")
            self._mode = self._call_name
            return pos + 1
        if final:
            raise Malformed(pos, "no calls")
        return pos

    def _call_name(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            m = _NAME_PAREN.match(text, pos)
            if m:
                self._name = [m.group(1)]
                return self._paren(text, m.end() - 1, final)
            m = _NAME.match(text, pos)
            if not m:
                raise Malformed(pos, "expected a function name")
            self._name = [m.group()]
            self._mode = self._call_name_more
            return m.end()
        if final:
            raise Malformed(pos, "unfinished list")
        return pos

    def _call_name_more(self, text: str, pos: int, final: bool) -> int:
        m = _NAME_MORE.match(text, pos)
        if m:
            self._name.append(m.group())
            pos = m.end()
        if pos < len(text):
            self._mode = self._paren
        elif final:
            raise Malformed(pos, "unfinished call")
        return pos

    def _paren(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] != "(":
                raise Malformed(pos, "expected '('")
            self._header("".join(self._name))
            self._args("{")
            self._n_args = 0
            self._mode = self._keyword
            return pos + 1
        if final:
            raise Malformed(pos, "unfinished call")
        return pos

    def _keyword(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] == ")":
                self._args("}")
                self._mode = self._next_call
                return pos + 1
            m = _KEYWORD_EQUALS.match(text, pos)
            if m:
                self._keyword_parts = [m.group(1)]
                return self._equals(text, m.end() - 1, final)
            m = _KEYWORD.match(text, pos)
            if not m:
                raise Malformed(pos, "expected a keyword argument")
            self._keyword_parts = [m.group()]
            self._mode = self._keyword_more
            return m.end()
        if final:
            raise Malformed(pos, "unfinished call")
        return pos

    def _keyword_more(self, text: str, pos: int, final: bool) -> int:
        m = _KEYWORD_MORE.match(text, pos)
        if m:
            self._keyword_parts.append(m.group())
            pos = m.end()
        if pos < len(text):
            self._mode = self._equals
        elif final:
            raise Malformed(pos, "unfinished call")
        return pos

    def _equals(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] != "=":
                raise Malformed(pos, "expected '='")
            key = json.dumps("".join(self._keyword_parts), ensure_ascii=False)
            self._args((", " if self._n_args else "") + key + ": ")
            self._n_args += 1
            self._value = _Value()
            self._mode = self._argument
            return pos + 1
        if final:
            raise Malformed(pos, "unfinished call")
        return pos

    def _argument(self, text: str, pos: int, final: bool) -> int:
        pos = self._value.feed(text, pos, final)
        if self._value.end:
            self._args(self._value.json(pos))
            self._mode = self._keyword
            return pos + (self._value.end == ",")
        if final:
            raise Malformed(pos, "unfinished value")
        return pos

    def _next_call(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] == ",":
                self._begin_call(pos)
                self._mode = self._call_name
            elif text[pos] == "]":
                self._mode = self._list_end
            else:
                raise Malformed(pos, "expected ',' or ']'")
            return pos + 1
        if final:
            raise Malformed(pos, "unfinished list")
        return pos

    def _list_end(self, text: str, pos: int, final: bool) -> int:
        i = skip_ws(text, pos)
        if text.startswith(END, i):
            self._end_call()
            return i + len(END)
        if not final and END.startswith(text[i:]):
            return i  # nothing yet, or the start of <|python_end|>
        self._end_call()
        return i
