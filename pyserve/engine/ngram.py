"""Prompt-lookup (n-gram) proposals for speculative decoding, as vLLM's "ngram" method: the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up
earlier in its prompt and output; the tokens that followed the most recent earlier match are
proposed (vLLM takes the earliest and looks at the whole history, pyserve the most recent,
nearer what the text is doing now, within LOOKUP_WINDOW tokens; drafts are verified either
way, so only acceptance can differ, never the output). The lookup is one native pass over the
request's token array (_C.ngram_match), about a microsecond a step at 300 tokens of history
against 34 µs for the numpy version it replaced.

Backoff: each request proposes up to its own lookahead (FIRST_LOOKAHEAD at first), which
next_lookahead moves after every verified step, so a request whose text does not repeat soon
stops paying for rejected rows; at 0 it pauses for PAUSE_TOKENS output tokens (twice as long
for each pause in a row without a kept draft between), then tries one draft again. A match
shorter than prompt_lookup_max is weaker evidence, and proposes fewer drafts (draft_limit)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pyserve import _native


# the tokens looked up: the most recent ones, so a step's cost is bounded in long contexts
LOOKUP_WINDOW = 4096


class TokenHistory:
    """A request's tokens as a numpy array that grows with them, so that a lookup reads the
    history without converting the whole list every step (np.asarray of 300 tokens took
    10 µs and of 3,000 58 µs, two thirds of propose's time at that length)."""

    def __init__(self):
        self._buffer = np.empty(0, dtype=np.int64)
        self._size = 0

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """The array of `tokens`, which extend the tokens of the last call (a request's
        tokens only grow); it is copied afresh if they do not."""
        size = len(tokens)
        if size < self._size:  # not this history's continuation: start over
            self._size = 0
        if size > len(self._buffer):
            grown = np.empty(max(size, 2 * len(self._buffer), 256), dtype=np.int64)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        if size > self._size:
            self._buffer[self._size: size] = tokens[self._size: size]
            self._size = size
        return self._buffer[:size]


def lookup(tokens: Sequence[int] | np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """Where a proposal after `tokens` (a list, or TokenHistory's array) starts, and how long
    the match behind it is: the most recent earlier occurrence of the longest suffix of n
    tokens (max_n down to min_n) that occurred before, ending before the last token (so at
    least one token follows it), within the last LOOKUP_WINDOW tokens; (-1, 0) when none did."""
    return _native.ngram_match(tokens, min_n, max_n, LOOKUP_WINDOW)


def propose(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int,
            by_match_length: bool = False) -> list[int]:
    """Up to k tokens to propose after `tokens`: what followed lookup's match; [] when none.
    by_match_length: at most draft_limit's count for the match's length (the scheduler's)."""
    start, n = lookup(tokens, min_n, max_n)
    if not n:
        return []
    if by_match_length:
        k = draft_limit(n, min_n, max_n, k)
    return [int(t) for t in tokens[start: start + k]]


def draft_limit(n: int, min_n: int, max_n: int, k: int) -> int:
    """How many drafts a match of n tokens may propose: a match shorter than prompt_lookup_max
    at most n - min_n + 1 (with lookup 2-4, a 2-token match one draft, a 3-token match two).
    Short matches are often chance: over the spec_decode benchmark's greedy answers, the token
    after a 2-token match came next 31-70 % of the time by prompt kind (free chat the least)
    against 73-97 % after a 4-token match, and a second draft behind a chance match is kept
    less often still. A simulation of the scheduler's backoff over those answers (a 2-row
    verify step costing 1.28 one-row steps, 3 rows 1.55, 5 rows 2.16, as measured in the exact
    kernels) gave free chat 1.000x against 0.995x without the limit, copy 1.86x against 1.84x,
    code 1.39x against 1.38x."""
    return k if n >= max_n else min(k, n - min_n + 1)


# a request whose drafts keep failing stops proposing for this many output tokens
PAUSE_TOKENS = 16
# A request's first proposal: at most this many drafts, one more after each step that keeps
# them all. With no history yet it is a guess, and in the exact float32 kernels each row of a
# verify step costs its own FMAs (a 3-row step about 1.5 one-row steps, a 5-row step 2.2).
# Interleaved runs (three engines taking turns, TPOT medians, two runs): copy 2.39x and 2.13x
# against 2.38x and 2.06x starting at 4, code 1.59x and 1.60x against 1.52x and 1.58x, chat
# 1.03x and 1.00x against 0.98x and 1.00x.
FIRST_LOOKAHEAD = 2


def next_lookahead(k: int, drafted: int, kept: int, limit: int) -> int:
    """How many drafts a request proposes next, after one verified step: one more when all
    were kept (up to the limit), half as many when none was (0: pause), else one past what
    was kept (the length that paid)."""
    if kept == drafted:
        return min(limit, k + 1)
    if kept == 0:
        return k // 2
    return min(limit, kept + 1)
