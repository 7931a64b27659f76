"""hermes: Hermes 2 Pro, Qwen2.5, Qwen3 — `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them, text around them is content.

Each call is one JSON object (CallObject) between the tags, whitespace allowed around it. A last
call whose closing tag never came (or came in part) is accepted when its object is complete (vLLM
reads `<tool_call>(.*)` at the end too). Unlike vLLM, whose extract keeps only the text before the first
call, all text outside the calls is content, so extract and streaming agree.
"""

from .base import ToolParser, skip_ws
from .json_stream import Malformed

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    START_MARKERS = (START,)

    def _open(self, marker: str):
        return self._call_object(self._close)

    def _close(self, text: str, pos: int, final: bool) -> int:
        pos = skip_ws(text, pos)
        if text.startswith(END, pos):
            self._end_call()
            return pos + len(END)
        rest = text[pos:]
        if not END.startswith(rest):
            raise Malformed(pos, f"expected {END}")
        if final:  # the stream ended in or before the closing tag: the call stands
            self._end_call()
            return len(text)
        return pos
