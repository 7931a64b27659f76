"""The CPU token-bitmask kernel against xgrammar's own apply (the reference), on random masks
with all-allowed, none-allowed and mixed words, some rows only, and a vocabulary that does not
fill the last word."""

import pytest
import torch
import xgrammar as xgr

from pyserve import _native


@pytest.mark.parametrize("rows_, vocab, which", [(1, 64, [0]), (5, 1000, [0, 2, 4]), (16, 49152, list(range(16))),
                                                  (3, 33, [1])])
def test_matches_xgrammar(rows_, vocab, which):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows_, words), generator=g, dtype=torch.int32)
    bitmask[:, ::3] = -1  # all allowed
    bitmask[:, 1::5] = 0  # none allowed
    logits = torch.randn(rows_, vocab, generator=g)
    ours, theirs = logits.clone(), logits.clone()
    _native.apply_token_bitmask(ours, bitmask, torch.tensor(which, dtype=torch.int64))
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=which, backend="torch_native")
    assert torch.equal(ours, theirs)
    untouched = [r for r in range(rows_) if r not in which]
    assert torch.equal(ours[untouched], logits[untouched])


def test_refuses_bad_shapes():
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="narrower"):
        _native.apply_token_bitmask(logits, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="out of range"):
        _native.apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([2]))
