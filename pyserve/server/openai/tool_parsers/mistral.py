"""mistral: Mistral tool calls after `[TOOL_CALLS]`, in the forms the tokenizer versions use:

- v0.3 (pre-v11): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a lone object too);
- v11+: `[TOOL_CALLS]name{...}`, v13: `[TOOL_CALLS]name[ARGS]{...}`, optionally with
  `[CALL_ID]id` before `[ARGS]`; several calls each repeat `[TOOL_CALLS]`.

Text before and after the calls is content. The model's own call id is not used: ids are ours.
"""

import re

from .base import ToolParser, skip_ws
from .json_stream import JsonStream, Malformed

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9]+")


class MistralToolParser(ToolParser):
    START_MARKERS = (BOT,)

    def _open(self, marker: str):
        return self._first

    def _first(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            if final:
                raise Malformed(pos, "no call")
            return pos
        c = text[pos]
        if c == "[":
            self._mode = self._list_first
            return pos + 1
        if c == "{":
            self._mode = self._call_object(self._last_object)
        elif _NAME.match(c):
            self._name = []
            self._mode = self._v11_name
        else:
            raise Malformed(pos, "expected a call")
        return pos

    # -- v0.3: a JSON list of call objects --------------------------------------------------------

    def _last_object(self, text: str, pos: int, final: bool) -> int:
        self._end_call()
        return pos

    def _list_first(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos < len(text):
            if text[pos] != "{":
                raise Malformed(pos, "expected a call object")
            self._mode = self._call_object(self._list_after)
        elif final:
            raise Malformed(pos, "unfinished list")
        return pos

    def _list_after(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            if final:
                raise Malformed(pos, "unfinished list")
            return pos
        if text[pos] == "]":
            self._end_call()
        elif text[pos] == ",":
            self._begin_call(pos)
            self._mode = self._list_first
        else:
            raise Malformed(pos, "expected ',' or ']'")
        return pos + 1

    # -- v11+: name, then [CALL_ID]id, [ARGS], then the arguments object ---------------------------

    def _v11_name(self, text: str, pos: int, final: bool) -> int:
        m = _NAME.match(text, pos)
        if m:
            self._name.append(m.group())
            pos = m.end()
        if pos < len(text):
            self._mode = self._v11_after_name
        elif final:
            raise Malformed(pos, "no arguments")
        return pos

    def _v11_after_name(self, text: str, pos: int, final: bool) -> int:
        return self._before_args(text, pos, final, (ARGS, CALL_ID))

    def _v11_id(self, text: str, pos: int, final: bool) -> int:
        m = _ID.match(text, pos)
        pos = m.end() if m else pos
        if pos < len(text):
            self._mode = self._v11_after_id
        elif final:
            raise Malformed(pos, "no arguments")
        return pos

    def _v11_after_id(self, text: str, pos: int, final: bool) -> int:
        return self._before_args(text, pos, final, (ARGS,))

    def _before_args(self, text: str, pos: int, final: bool, markers: tuple[str, ...]) -> int:
        """After the name (or the call id), whitespace allowed: `{` or one of markers. The header
        goes out only then, so a name that turns out to be prose is released as content."""
        pos = skip_ws(text, pos)
        if pos == len(text):
            if final:
                raise Malformed(pos, "no arguments")
            return pos
        found = next((m for m in markers if text.startswith(m, pos)), "")
        if not found and text[pos] != "{":
            if not final and any(m.startswith(text[pos:]) for m in markers):
                return pos  # a marker may be arriving
            raise Malformed(pos, "expected arguments")
        if not self._header_sent:
            self._header("".join(self._name))
        if found == CALL_ID:
            self._mode = self._v11_id
        else:
            self._js = JsonStream()
            self._mode = self._v11_args
        return pos + len(found)

    def _v11_args(self, text: str, pos: int, final: bool) -> int:
        pos = self._js.feed(text, pos, final)
        self._args(self._js.take())
        if self._js.done:
            self._end_call()
        elif final:
            raise Malformed(pos, "unfinished arguments")
        return pos
