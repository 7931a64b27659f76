"""Incremental detokenization with stop strings.

Text grows one token at a time by decoding a short sliding window of ids twice: the window up
to the last emitted token, and the window including the new ones; the difference is the new
text. Nothing is emitted while the decode ends in U+FFFD (a UTF-8 character still split across
tokens, byte-level BPE or SentencePiece byte fallback), so characters never come out broken,
and the window gives each token its left context (leading spaces of SentencePiece pieces).
(tokenizers' DecodeStream drops byte-fallback characters, hence this classic scheme.) Stop strings are searched only where new text could complete
one, and the last (longest stop string - 1) characters are held back from streaming while the
request runs, so streamed text never shows a stop string unless it was asked for. The final
text is exactly the concatenation of everything streamed."""

from __future__ import annotations

# Prompt tokens fed to the stream first, so the first output token is decoded in context
# (leading spaces of SentencePiece pieces, byte-level merges).
_CONTEXT_TOKENS = 6


def backend_tokenizer(tokenizer):
    return getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop_strings: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self._backend = backend_tokenizer(tokenizer)
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: context for the next decode
        self._read_offset = len(self._ids)  # ids before this are already in self.text
        self._stop_strings = stop_strings
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text = ""
        self._sent = 0

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Appends token_id's text; returns the stop string it completed, if any (the text is
        then cut before it, or after it with include_stop_str_in_output)."""
        piece = self._next_piece(token_id)
        if not piece:
            return None
        start = max(0, len(self.text) - self._holdback)
        self.text += piece
        if not (check_stop and self._stop_strings):
            return None
        hits = [(self.text.find(s, start), s) for s in self._stop_strings]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def _next_piece(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._backend.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        after = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before):]

    def new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, keeps back what could start a stop string."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._holdback)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta

    @property
    def emitted_text(self) -> str:
        """Everything handed out by new_text so far."""
        return self.text[: self._sent]
