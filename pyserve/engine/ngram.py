"""Prompt-lookup (n-gram) proposals for speculative decoding, as vLLM's "ngram" method: the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked up
earlier in its prompt and output; the tokens that followed the most recent earlier match are
proposed. Vectorised over the token history (numpy), no Python loop per token.

Backoff: each request proposes up to its own lookahead, which next_lookahead moves after every
verified step, so a request whose text does not repeat soon stops paying for rejected rows;
at 0 it pauses for PAUSE_TOKENS output tokens (twice as long for each pause in a row without
a kept draft between), then tries one draft again."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


# the tokens looked up: the most recent ones, so a step's cost is bounded in long contexts
LOOKUP_WINDOW = 4096


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens to propose after `tokens`; [] when no suffix n-gram recurs."""
    history = np.asarray(tokens[-LOOKUP_WINDOW:], dtype=np.int64)
    size = len(history)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # windows that start before the suffix and end before the last token, so that a
        # match has at least one token after it
        windows = sliding_window_view(history[: size - 1], n)
        hits = np.flatnonzero((windows == history[size - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return history[start: start + k].tolist()
    return []



# a request whose drafts keep failing stops proposing for this many output tokens
PAUSE_TOKENS = 16


def next_lookahead(k: int, drafted: int, kept: int, limit: int) -> int:
    """How many drafts a request proposes next, after one verified step: one more when all
    were kept (up to the limit), half as many when none was (0: pause), else one past what
    was kept (the length that paid)."""
    if kept == drafted:
        return min(limit, k + 1)
    if kept == 0:
        return k // 2
    return min(limit, kept + 1)
