"""Greedy verification of speculative drafts: the target model's argmax on each draft row
decides. A draft is kept while it equals the target's choice, so a greedy request's output is
what it would be without speculation; the target's own token ends each step's list, so a step
yields one token more than it accepted drafts.

The drafts' rows are the last rows of the step's logits (the runner puts them after the
sampled and prompt-logprob rows): len(drafts) + 1 rows per sequence, the last real token's
and one per draft."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accepted(argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Greedy verification: argmax[i] is the target's choice after drafts[:i]; the drafts are
    kept while they equal it, then the target's own token ends the list (so one token more
    than the drafts accepted: what a step without speculation would have made, and more)."""
    out = []
    for choice, draft in zip(argmax, drafts):
        out.append(int(choice))
        if choice != draft:
            return out
    out.append(int(argmax[len(drafts)]))
    return out


def verify_argmax(logits: torch.Tensor | None, drafts: list[list[int]]) -> torch.Tensor | None:
    """The target's greedy choice on every drafts row (the last rows of the logits)."""
    if not drafts:
        return None
    rows = sum(len(d) + 1 for d in drafts)
    return logits[logits.shape[0] - rows:].argmax(dim=-1)


def verify(argmax: torch.Tensor | None, drafts: list[list[int]]) -> list[list[int]]:
    """Each sequence's kept tokens (accepted drafts, then the target's own)."""
    if argmax is None:
        return []
    choices, out, row = argmax.tolist(), [], 0
    for d in drafts:
        out.append(accepted(choices[row: row + len(d) + 1], d))
        row += len(d) + 1
    return out
