"""kv/residency.py: a tensor's resident bytes are the pages written, not its size."""

import mmap

import torch

from pyserve.kv.residency import resident_bytes


def test_only_written_pages_are_resident():
    pool = torch.empty(96 * 1024 * 1024, dtype=torch.uint8)  # large: its own untouched mmap
    before = resident_bytes(pool)
    pool[: 32 * 1024 * 1024].fill_(1)
    after = resident_bytes(pool)
    assert before <= 2 * mmap.PAGESIZE  # at most the pages it shares with its neighbours
    assert 32 * 1024 * 1024 <= after - before <= 32 * 1024 * 1024 + 2 * mmap.PAGESIZE
    # a view answers for its whole storage (one allocation holds every layer's cache)
    assert resident_bytes(pool[64 * 1024 * 1024:]) == after


def test_an_empty_tensor_holds_nothing():
    assert resident_bytes(torch.empty(0)) == 0
