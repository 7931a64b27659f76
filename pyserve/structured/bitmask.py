"""Token bitmasks: one int32 word per 32 vocabulary entries, bit set = token allowed (xgrammar's
layout). Filled on the event loop from the constrained requests' matchers, applied to their
logits rows inside the step."""

from __future__ import annotations

import torch


def fill_bitmask(matchers: dict[int, object], num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32 for a step's sampled rows: row i holds what matcher
    matchers[i] allows next; rows without a matcher allow every token (and are not applied)."""
    bitmask = allowing_all(num_rows, vocab_size)
    for row, matcher in matchers.items():
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def allowing_all(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask of num_rows rows that allow every token (what xgrammar's allocate_token_bitmask
    makes)."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Row `row` of the bitmask allows `token` alone."""
    bitmask[row].zero_()
    bit = 1 << (token % 32)
    bitmask[row, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32's two's complement


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets the logits of disallowed tokens to -inf, in place, in the given rows (bitmask and
    logits rows align)."""
    if logits.device.type == "cpu":  # our kernel: a word at a time, 10x xgrammar's CPU one
        from pyserve import _native

        _native.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows, backend="torch_native")
