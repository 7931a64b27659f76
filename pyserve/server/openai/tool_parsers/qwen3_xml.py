"""qwen3_xml (alias qwen3_coder): Qwen3-Coder's XML-like calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Several `<function=...>` may share one `<tool_call>`, and a bare `<function=...>` without the
wrapper is accepted too, as in vLLM. A value is the text up to `</parameter>` (or, when the model
leaves it out, up to the next `<parameter=`, `</function>` or `</tool_call>`), less one leading
and one trailing newline. An unfinished last function (the stream ended) is kept, as vLLM keeps it.

Values are typed by the tool's JSON schema when tools are given (vLLM's rules, read through
json): integer, number, boolean, object and array are parsed (objects and arrays with
ast.literal_eval as the fallback) and stay strings when they do not parse as that type; "null"
(any case) is null whatever the type; anything else, or a parameter the schema does not name, is
a string. A string value streams as it arrives (held only while it could still be "null", and one
trailing newline); a typed value is written once it ends. Arguments are
`json.dumps(params, ensure_ascii=False)`, built piece by piece, with a parsed value's NaN,
infinities and lone surrogates made strict JSON (server/strict_json.py).
"""

import ast
import json
import re

from pyserve.server.strict_json import json_text

from .base import MarkerSearch, ToolParser, skip_ws
from .json_stream import Malformed, escape

WRAP, WRAP_END = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
_TAG_NAME = re.compile(r"[^>\n<]+")
_VALUE_ENDS = MarkerSearch((PARAM_END, PARAM, FUNC_END, WRAP_END))
_TYPED = {"integer", "number", "boolean", "object", "array"}
_PYTHON_TYPES = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list, tuple)}


def _schemas(tools: list[dict]) -> dict[str, dict]:
    """function name -> {parameter: schema}"""
    out = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _type(schema) -> str:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):
        t = next((x for x in t if x != "null"), None)
    return t.strip().lower() if isinstance(t, str) else "string"


def _convert(value: str, kind: str):
    if value.lower() == "null":
        return None
    stripped = value.strip()
    if kind == "boolean":
        low = stripped.lower()
        return low == "true" if low in ("true", "false") else value
    try:
        parsed = json.loads(stripped)
    except ValueError:
        parsed = value
        if kind in ("object", "array"):
            try:
                parsed = ast.literal_eval(stripped)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                pass
    if isinstance(parsed, _PYTHON_TYPES[kind]) and not isinstance(parsed, bool):
        return parsed
    return value


class Qwen3XmlToolParser(ToolParser):
    START_MARKERS = (WRAP, FUNC)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._schemas = _schemas(self.tools)

    def _open(self, marker: str):
        self._wrapped = marker == WRAP
        self._name: list[str] = []
        return self._function_open if self._wrapped else self._function_name

    def _function_open(self, text: str, pos: int, final: bool) -> int:
        """Inside <tool_call>: <function=...>, or </tool_call> once a function was read."""
        pos = skip_ws(text, pos)
        if text.startswith(FUNC, pos):
            if self._header_sent:  # a second function in the same <tool_call>
                self._begin_call(pos)
            self._name = []
            self._mode = self._function_name
            return pos + len(FUNC)
        if self._header_sent and text.startswith(WRAP_END, pos):
            self._end_call()
            return pos + len(WRAP_END)
        rest = text[pos:]
        if self._header_sent and final and WRAP_END.startswith(rest):  # cut in or before the tag
            self._end_call()
            return len(text)
        if final or not (FUNC.startswith(rest) or WRAP_END.startswith(rest)):
            raise Malformed(pos, "expected <function=")
        return pos

    def _tag_name(self, text: str, pos: int, final: bool) -> tuple[int, str | None]:
        """The name of <function=NAME> or <parameter=NAME>: (pos, name once '>' is read)."""
        m = _TAG_NAME.match(text, pos)
        if m:
            self._name.append(m.group())
            pos = m.end()
        if pos == len(text):
            if final:
                raise Malformed(pos, "unfinished tag")
            return pos, None
        name = "".join(self._name).strip()
        if text[pos] != ">" or not name:
            raise Malformed(pos, "bad tag")
        self._name = []
        return pos + 1, name

    def _function_name(self, text: str, pos: int, final: bool) -> int:
        pos, name = self._tag_name(text, pos, final)
        if name is not None:
            self._header(name)
            self._args("{")
            self._params = self._schemas.get(name, {})
            self._n_params = 0
            self._mode = self._body
        return pos

    def _body(self, text: str, pos: int, final: bool) -> int:
        """Between parameters: text that is no tag is ignored, as vLLM's regexes ignore it."""
        found = _VALUE_ENDS.find(text, pos)
        if found is None:
            if final:
                self._close_function()
                self._end_call()
                return len(text)
            return _VALUE_ENDS.safe_end(text, pos)
        i, tag = found
        if tag == PARAM:
            self._name = []
            self._mode = self._param_name
        elif tag == FUNC_END:
            self._close_function()
            if self._wrapped:
                self._mode = self._function_open
            else:
                self._end_call()
        elif tag == WRAP_END:
            self._close_function()
            self._end_call()
        return i + len(tag)  # a stray </parameter> is skipped too

    def _close_function(self):
        self._args("}")

    def _param_name(self, text: str, pos: int, final: bool) -> int:
        pos, name = self._tag_name(text, pos, final)
        if name is not None:
            key = json.dumps(name, ensure_ascii=False)
            self._args((", " if self._n_params else "") + key + ": ")
            self._n_params += 1
            kind = _type(self._params.get(name)) if name in self._params else "string"
            self._kind = kind if kind in _TYPED else "string"
            self._raw: list[str] = []  # typed: the whole value; string: its start while it may be "null"
            self._first = True  # the leading newline is still to be dropped
            self._newline = False  # a trailing newline held back
            self._opened = False  # the string's opening quote has been written
            self._mode = self._value
        return pos

    def _value(self, text: str, pos: int, final: bool) -> int:
        found = _VALUE_ENDS.find(text, pos)
        end = found[0] if found else len(text) if final else _VALUE_ENDS.safe_end(text, pos)
        self._value_piece(text[pos:end])
        if found or final:
            self._value_end()
            self._mode = self._body
            if found and found[1] == PARAM_END:
                return end + len(PARAM_END)
        return end

    def _value_piece(self, s: str):
        if not s:
            return
        if self._first:
            self._first = False
            if s[0] == "\n":
                s = s[1:]
        if self._newline:
            s = "\n" + s
        self._newline = s.endswith("\n")
        if self._newline:
            s = s[:-1]
        if self._kind != "string" or not self._opened:
            self._raw.append(s)
            if self._kind == "string":
                head = "".join(self._raw)
                if len(head) > 4 or not "null".startswith(head.lower()):
                    self._args('"' + escape(head))
                    self._opened = True
        else:
            self._args(escape(s))

    def _value_end(self):
        if self._opened:
            self._args('"')
            return
        value = "".join(self._raw)
        if self._kind == "string":
            self._args("null" if value.lower() == "null" else '"' + escape(value) + '"')
        else:
            try:
                text = json_text(_convert(value, self._kind))
            except (TypeError, ValueError, RecursionError):
                # literal_eval read what JSON has not (bytes, a set, a complex number): a string
                text = '"' + escape(value) + '"'
            self._args(text)
