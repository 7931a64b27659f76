"""vLLM's thinking_token_budget: the reasoning of a request may take at most this many tokens;
then the token that ends it (</think>) is forced, and the answer follows as usual.

Pure bookkeeping over token ids, one tracker per completion. Counted as vLLM counts: the
tokens after the last reasoning start marker, in the prompt (a chat template that opens
<think> itself) and in the output; an end marker closes the reasoning (the model's own, or
the forced one), and a later start marker opens a new one, counted from zero. The engine asks
forced_token() when it schedules the completion's next row and masks that row's logits to the
one token (a step's grammar bitmask carries the row), so the forced token is sampled at any
temperature, with logprob 0.
"""

from __future__ import annotations


class ThinkingBudget:
    def __init__(self, budget: int, start: int, end: int, prompt_token_ids: list[int]):
        """budget: thinking_token_budget (>= 0); start, end: the reasoning markers' token ids."""
        self.budget, self.start, self.end = budget, start, end
        last_start = last_index(prompt_token_ids, start)
        self.thinking = last_start > last_index(prompt_token_ids, end)
        self.count = len(prompt_token_ids) - last_start - 1 if self.thinking else 0

    def forced_token(self) -> int | None:
        """The token the completion's next row must be: the end marker once the reasoning has
        spent its budget, else None."""
        return self.end if self.thinking and self.count >= self.budget else None

    def accept(self, token: int) -> None:
        """Follows the completion's next token."""
        if token == self.start:
            self.thinking, self.count = True, 0
        elif token == self.end:
            self.thinking = False
        elif self.thinking:
            self.count += 1


def last_index(ids: list[int], token: int) -> int:
    """Where token last occurs in ids; -1 if nowhere."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
