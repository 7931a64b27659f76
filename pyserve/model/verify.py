"""Verification of speculative drafts. The drafts' rows are the last rows of the step's logits
(the runner puts them after the sampled and prompt-logprob rows): len(drafts) + 1 rows per
sequence, the last real token's and one per draft; row i is the model's distribution after
drafts[:i].

Greedy requests: a draft is kept while it equals the model's argmax, so the output is what it
would be without speculation. Sampled requests: rejection sampling (sampler.draft_verdicts)
keeps a draft with the probability the model gives it and otherwise draws from the rest, so
the tokens are distributed exactly as without speculation. Either way the first rejected
draft is replaced by the model's own token and ends the step, and when every draft is kept
the last row adds one more: a step yields one token more than the drafts it kept."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pyserve.structured.bitmask import apply_bitmask
from pyserve.model.sampler import SamplingMetadata, draft_verdicts, read_result_table, result_table


def verify_on_device(logits: torch.Tensor | None, drafts: list[list[int]], sampled: list[int],
                     meta: SamplingMetadata | None, default: torch.Generator,
                     max_logprobs: int = -1, grammar: tuple | None = None):
    """-> ([2, rows] int64 on the logits' device: per drafts row, the token taken there if its
    draft is rejected (or after the last), and whether its draft is kept; with max_logprobs
    >= 0, the sampler's logprob table of each row's token). sampled: which sequences
    (indices into drafts) are sampled; meta covers their rows, in order. grammar: (token
    bitmask, the drafts rows it constrains), applied first, as the sampler applies its own."""
    if not drafts:
        return None, None
    rows = sum(len(d) + 1 for d in drafts)
    block = logits[logits.shape[0] - rows:]
    if grammar is not None:
        apply_bitmask(block, *grammar)
    draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], device=block.device)
    choice = block.argmax(dim=-1)
    accept = choice == draft_ids
    if meta is not None:
        starts = [0]
        for d in drafts:
            starts.append(starts[-1] + len(d) + 1)
        index = torch.tensor([r for i in sampled for r in range(starts[i], starts[i + 1])],
                             device=block.device)
        kept, drawn = draft_verdicts(block[index], meta, draft_ids[index], default)
        accept[index], choice[index] = kept, drawn
    logprobs = None
    if max_logprobs >= 0:  # of the token each row ends up with (raw logits, as the sampler's)
        logprobs = result_table(block, torch.where(accept, draft_ids, choice), max_logprobs)
    return torch.stack([choice, accept.long()]), logprobs


def verify(table: torch.Tensor | None, drafts: list[list[int]], logprobs: torch.Tensor | None = None,
           max_logprobs: int = -1) -> tuple[list[list[int]], list]:
    """(each sequence's tokens for the step: its kept drafts, then the model's own; each
    sequence's SampledLogprobs of those tokens, row j for token j, or None), from
    verify_on_device's tables copied to the host."""
    if table is None:
        return [], []
    choice, accept = table.tolist()
    tokens, per_sequence, row = [], [], 0
    for d in drafts:
        rows = slice(row, row + len(d) + 1)
        tokens.append(walk(choice[rows], accept[rows], d))
        per_sequence.append(None if logprobs is None
                            else read_result_table(logprobs[rows], max_logprobs).logprobs)
        row += len(d) + 1
    return tokens, per_sequence


def walk(choice: Sequence[int], accept: Sequence[int], drafts: Sequence[int]) -> list[int]:
    out = []
    for i, draft in enumerate(drafts):
        if not accept[i]:
            out.append(int(choice[i]))
            return out
        out.append(int(draft))
    out.append(int(choice[len(drafts)]))
    return out


def accepted(argmax: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Greedy verification alone: argmax[i] is the model's choice after drafts[:i]."""
    return walk(argmax, [a == d for a, d in zip(argmax, drafts)] + [False], drafts)
