"""Reasoning parsers: split a model's text into reasoning (between <think> and </think>) and
content, whole (extract) or streamed (feed/finish). Pure Python over plain strings.

    parser = reasoning_parser("deepseek_r1")
    parser.extract(text) -> (reasoning, content)      # None for an empty part
    parser.feed(delta) -> [{"reasoning": ...} | {"content": ...}]; parser.finish() at the end

The two differ in where the output starts:
- deepseek_r1: inside reasoning, because the chat template has already opened <think>. The output
  may start with an explicit <think> anyway (after whitespace; it is dropped), reasoning runs to
  the first </think>, the rest is content; with no </think> everything is reasoning.
- qwen3: in content. Reasoning happens only when the output opens with <think> (after
  whitespace); it runs to the first </think>, or to the end when none comes. Output without it
  (enable_thinking false: the template wrote an empty think block into the prompt) is content.
`starts_in_reasoning` overrides the default (qwen3 with a template that opens <think> itself, as
Qwen3-*-Thinking-2507 does, behaves as deepseek_r1); `enable_thinking=False` makes everything
content. After </think>, tags are plain text.

Streaming holds back only what could still be a marker: leading whitespace while a <think> may
follow, and a tail that could be the start of </think>; so for any split the fragments join to
exactly what extract() returns, and each character is handled a bounded number of times.
"""

__all__ = ["REASONING_PARSERS", "reasoning_parser", "ReasoningParser",
           "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser"]

_WS = " \t\n\r"
_LEADING, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    start = "<think>"
    end = "</think>"
    STARTS_IN_REASONING = False

    def __init__(self, *, enable_thinking: bool = True, starts_in_reasoning: bool | None = None):
        self.enable_thinking = enable_thinking
        self.starts_in_reasoning = (self.STARTS_IN_REASONING if starts_in_reasoning is None
                                    else starts_in_reasoning)
        self._state = _LEADING if enable_thinking else _CONTENT
        self._pending = ""
        self._lead: list[str] = []  # leading whitespace, while a <think> may still follow
        self._out: list[list] = []  # [kind, parts]

    @property
    def ended(self) -> bool:
        """Whether everything from here on is content (the streaming view of reasoning_ended)."""
        return self._state == _CONTENT

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole output."""
        if not self.enable_thinking:
            return None, text or None
        stripped = text.lstrip(_WS)
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif self.starts_in_reasoning:
            body = text
        else:
            return None, text or None
        reasoning, found, content = body.partition(self.end)
        return reasoning or None, (content if found else "") or None

    def reasoning_ended(self, text: str) -> bool:
        """Whether the output so far has finished its reasoning (or will have none), so that what
        follows is content, e.g. to start a grammar there. O(len(text)): per token, use `ended`."""
        if not self.enable_thinking:
            return True
        stripped = text.lstrip(_WS)
        if stripped.startswith(self.start):
            return self.end in stripped[len(self.start):]
        if self.starts_in_reasoning:
            return self.end in text
        return bool(stripped) and not self.start.startswith(stripped)

    def feed(self, delta: str) -> list[dict]:
        if delta:
            text = self._pending + delta
            self._pending = text[self._advance(text, False):]
        return self._take()

    def finish(self) -> list[dict]:
        text, self._pending = self._pending, ""
        self._advance(text, True)
        if self._lead:  # only whitespace came: it belongs to the part the output starts in
            self._emit("reasoning" if self.starts_in_reasoning else "content", "".join(self._lead))
            self._lead = []
        return self._take()

    def _advance(self, text: str, final: bool) -> int:
        pos, n = 0, len(text)
        while pos < n:
            if self._state == _CONTENT:
                self._emit("content", text[pos:])
                return n
            if self._state == _REASONING:
                i = text.find(self.end, pos)
                if i >= 0:
                    self._emit("reasoning", text[pos:i])
                    self._state = _CONTENT
                    pos = i + len(self.end)
                    continue
                stop = n if final else _safe_end(text, pos, self.end)
                self._emit("reasoning", text[pos:stop])
                return stop
            i = pos  # _LEADING
            while i < n and text[i] in _WS:
                i += 1
            if i > pos:
                self._lead.append(text[pos:i])
            if i == n:
                return n
            rest = text[i:i + len(self.start)]
            if rest == self.start:
                self._lead = []
                self._state = _REASONING
                pos = i + len(self.start)
                continue
            if not final and len(rest) < len(self.start) and self.start.startswith(rest):
                return i
            kind = "reasoning" if self.starts_in_reasoning else "content"
            if self._lead:
                self._emit(kind, "".join(self._lead))
                self._lead = []
            self._state = _REASONING if self.starts_in_reasoning else _CONTENT
            pos = i
        return pos

    def _emit(self, kind: str, s: str):
        if not s:
            return
        if self._out and self._out[-1][0] == kind:
            self._out[-1][1].append(s)
        else:
            self._out.append([kind, [s]])

    def _take(self) -> list[dict]:
        out = [{kind: "".join(parts)} for kind, parts in self._out]
        self._out = []
        return out


def _safe_end(text: str, pos: int, marker: str) -> int:
    """Where text stops being safe to emit: before a tail that could begin marker."""
    n = len(text)
    for k in range(min(len(marker) - 1, n - pos), 0, -1):
        if marker.startswith(text[n - k:]):
            return n - k
    return n


class DeepSeekR1ReasoningParser(ReasoningParser):
    STARTS_IN_REASONING = True


class Qwen3ReasoningParser(ReasoningParser):
    STARTS_IN_REASONING = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def reasoning_parser(name: str, **options) -> ReasoningParser:
    """A fresh parser (one per request); options: enable_thinking, starts_in_reasoning."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(REASONING_PARSERS))}")
    return cls(**options)
