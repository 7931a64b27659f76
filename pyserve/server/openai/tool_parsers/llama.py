"""llama3_json: Llama 3.x (and 4) JSON tool calls — an optional `<|python_tag|>`, then one JSON
object `{"name": ..., "parameters"|"arguments": {...}}`, or several separated by `;`.

The calls must open the output (after whitespace), as in vLLM's streaming parser, or follow a
`<|python_tag|>` anywhere; text after the last call is content (vLLM's extract drops it). An
object that is not a call (no "name") makes the whole output content, so `{"answer": 42}` is an
answer, not a call.
"""

from .base import ToolParser, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    START_MARKERS = (TAG,)

    def _start(self, text: str, pos: int, final: bool) -> int:
        i = skip_ws(text, pos)
        self._text(text[pos:i])
        if i == len(text):
            return i
        if text[i] == "{":
            self._begin_call(i)
            self._mode = self._open(TAG)
        else:
            self._mode = self._content
        return i

    def _open(self, marker: str):
        return self._call_object(self._between)

    def _between(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if pos == len(text):
            if final:
                self._end_call()
            return pos
        c = text[pos]
        if c in ";{":  # another call; Llama sometimes leaves out the `;`
            self._begin_call(pos)
            self._mode = self._open(TAG)
            return pos + 1 if c == ";" else pos
        self._end_call()
        return pos
