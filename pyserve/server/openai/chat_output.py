"""What one chat choice's generated text says, in OpenAI's message fields: `content`, the
reasoning (`reasoning`, and `reasoning_content`, the older name, with --reasoning-parser) and
`tool_calls`. The text first goes through the reasoning parser (if any), then the answer part
through the tool-call handling of the request's mode:

    none       the answer is content
    named      the grammar made the whole answer the named function's arguments
    required   the grammar made it a JSON list of {"name", "parameters"}
    auto       --tool-call-parser finds calls in the model's own text

A forced call (named or required) is never content, and max_tokens cutting it short leaves no
call at all (finish_reason "length", tool_calls empty), as vLLM answers: half a JSON object is
not a call a client can run. So a stream holds a forced call's text and sends the call whole
at the end, once it is known not to be cut.

Whole responses use whole(); streams call delta() per piece and finish() at the end, and the
concatenated fragments are what whole() gives for the same text (same arguments strings).
A choice whose tools were called finishes with "tool_calls" where it would say "stop"
(vLLM: auto and required; a named function keeps "stop", as OpenAI's), and on the chat route
also where max_tokens cut an auto call's text (vLLM's rule; see finish_reason)."""

from __future__ import annotations

import json
import uuid

from pyserve.server.strict_json import json_text, valid_escapes, valid_unicode


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict]:
    """The grammar's list of {"name", "parameters"} -> calls; [] if it is not (yet) one."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    # a name is the grammar's enum of the tools' names; decoded from escapes it could still
    # hold a lone surrogate, which no UTF-8 writer takes (U+FFFD, as in the arguments)
    return [_call(valid_unicode(item["name"]), json_text(item.get("parameters", {})))
            for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)]


class ChoiceOutput:
    def __init__(self, mode: str = "none", forced_name: str | None = None, tool_parser=None,
                 reasoning_parser=None, include_reasoning: bool = True,
                 parallel_tool_calls: bool = True, reasoning_markers: tuple[int, int] | None = None,
                 calls_end_on_length: bool = False):
        """include_reasoning False drops the reasoning from the response; parallel_tool_calls
        False keeps the first call only (vLLM's two switches). reasoning_markers: the token ids
        of the parser's start and end markers (one token each), which count the reasoning's
        tokens (count); None: not counted. calls_end_on_length: auto calls make the finish
        reason "tool_calls" even when max_tokens cut the text (vLLM's chat route; the APIs
        that translate chat answers read the cut as theirs: max_tokens, incomplete)."""
        self.mode = mode
        self.calls_end_on_length = calls_end_on_length
        self.markers = reasoning_markers if reasoning_parser is not None else None
        self.reasoning_tokens = 0
        # whether the next token is reasoning: the output starts inside it where the parser says
        self._in_reasoning = (reasoning_parser is not None and reasoning_parser.enable_thinking
                              and reasoning_parser.starts_in_reasoning)
        self.include_reasoning = include_reasoning
        self.parallel = parallel_tool_calls
        self.forced_name = forced_name
        self.tools = tool_parser  # auto: a fresh parser for this choice
        self.reasoning = reasoning_parser
        self.tools_called = False
        self._answer = ""  # named, required: the answer so far (its calls come at the end)

    # -- whole responses -------------------------------------------------------------------
    def whole(self, text: str, engine_reason: str | None = None) -> dict:
        """engine_reason: why the engine ended the choice ("length": max_tokens cut it)."""
        fields: dict = {}
        answer = text
        if self.reasoning is not None:
            reasoning, answer = self.reasoning.extract(text)
            fields["reasoning"] = fields["reasoning_content"] = reasoning
            answer = answer or ""
        calls: list[dict] = []
        content: str | None = answer
        if self.mode in ("named", "required"):
            calls, content = self._forced_calls(answer, engine_reason), ""
        elif self.mode == "auto":
            found = self.tools.extract(answer)
            if found.tools_called:
                calls = [_call(c.name, c.arguments) for c in found.tool_calls]
                content = found.content
        self.tools_called = bool(calls) and self.mode != "named"
        fields["content"] = content
        fields["tool_calls"] = calls if self.parallel else calls[:1]
        if not self.include_reasoning:
            fields.pop("reasoning", None), fields.pop("reasoning_content", None)
        return fields

    # -- streams ---------------------------------------------------------------------------
    def delta(self, text: str) -> dict:
        """The delta fields for the next piece of text (possibly none yet)."""
        if self.reasoning is None:
            return self._kept(self._answer_delta(text))
        return self._kept(self._from_reasoning(self.reasoning.feed(text)))

    def finish(self, engine_reason: str | None = None) -> dict:
        return self._kept(self._finish(engine_reason))

    def _kept(self, delta: dict) -> dict:
        if not self.include_reasoning:
            delta.pop("reasoning", None), delta.pop("reasoning_content", None)
        if not self.parallel and "tool_calls" in delta:
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c["index"] == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]
        return delta

    def _finish(self, engine_reason: str | None) -> dict:
        merged = self._from_reasoning(self.reasoning.finish()) if self.reasoning is not None else {}
        if self.mode == "auto":
            merge_delta(merged, self._tool_fragments(self.tools.finish()))
        elif self.mode in ("named", "required"):
            calls = self._forced_calls(self._answer, engine_reason)
            if calls:
                self.tools_called = self.mode == "required"
                merge_delta(merged, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return merged

    def _forced_calls(self, answer: str, engine_reason: str | None) -> list[dict]:
        """The calls a forced answer makes: none where max_tokens cut it."""
        if engine_reason == "length":
            return []
        if self.mode == "named":  # the grammar's JSON as written, but for lone surrogates
            return [_call(self.forced_name, valid_escapes(answer))]
        return _required_calls(answer)

    def _from_reasoning(self, fragments: list[dict]) -> dict:
        """Reasoning fragments as they are; the answer's through the tool handling."""
        merged: dict = {}
        for fragment in fragments:
            if "reasoning" in fragment:
                merge_delta(merged, {"reasoning": fragment["reasoning"],
                                "reasoning_content": fragment["reasoning"]})
            else:
                merge_delta(merged, self._answer_delta(fragment.get("content", "")))
        return merged

    def _answer_delta(self, text: str) -> dict:
        if self.mode == "none":
            return {"content": text}  # every piece, empty ones too (text held for stop strings)
        if self.mode in ("named", "required"):
            self._answer += text  # sent at the end: a call cut by max_tokens is no call
            return {}
        return self._tool_fragments(self.tools.feed(text))

    def _tool_fragments(self, fragments: list[dict]) -> dict:
        merged: dict = {}
        for fragment in fragments:
            if fragment.get("tool_calls"):
                self.tools_called = True
            merge_delta(merged, fragment)
        return merged

    def count(self, token_ids) -> list[bool] | tuple:
        """Counts the reasoning's tokens among the next generated ones, markers included, as
        vLLM counts them: from the start marker (or the output's start, for a template that
        opened the reasoning itself) to the end marker. Returns which of them are reasoning
        (none known without markers)."""
        if self.markers is None:
            return ()
        start, end = self.markers
        flags = []
        for token in token_ids:
            if token == start and self.reasoning.enable_thinking:
                self._in_reasoning = True
            flags.append(self._in_reasoning)
            if self._in_reasoning:
                self.reasoning_tokens += 1
                if token == end:
                    self._in_reasoning = False
        return flags

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" once calls were made: on a stop, and with calls_end_on_length (auto
        calls, as vLLM's chat route reports them, a streamed call cut short included) on a cut
        by max_tokens too."""
        cut = engine_reason == "length" and self.mode == "auto" and self.calls_end_on_length
        if self.tools_called and (engine_reason == "stop" or cut):
            return "tool_calls"
        return engine_reason


def merge_delta(merged: dict, fragment: dict) -> None:
    """Adds a delta fragment to a chunk's delta: text fields concatenate, calls append."""
    for key, value in fragment.items():
        if key == "tool_calls":
            calls = merged.setdefault("tool_calls", [])
            for call in value:
                last = calls[-1] if calls else None
                if last is not None and last["index"] == call["index"] and set(call) == {"index", "function"}:
                    # more arguments of the same call: one entry a call in a chunk
                    function = last.setdefault("function", {})
                    function["arguments"] = function.get("arguments", "") + call["function"].get("arguments", "")
                else:
                    calls.append({**call, "function": dict(call.get("function", {}))})
        elif value or key not in merged:
            merged[key] = merged.get(key, "") + (value or "")
