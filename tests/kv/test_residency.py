"""kv/residency.py: a tensor's resident bytes are the pages written, not its size."""

import mmap

import torch

from pyserve.kv.residency import resident_bytes

MiB = 1024 * 1024


def test_only_written_pages_are_resident():
    # a fresh anonymous mapping, so that no page of it was written before (an allocator could
    # hand back memory it already touched)
    region = mmap.mmap(-1, 96 * MiB)
    pool = torch.frombuffer(region, dtype=torch.uint8)
    assert resident_bytes(pool) == 0
    pool[: 32 * MiB].fill_(1)
    assert resident_bytes(pool) == 32 * MiB
    # a view answers for its whole storage (one allocation holds every layer's cache)
    assert resident_bytes(pool[64 * MiB:]) == 32 * MiB
    del pool


def test_an_empty_tensor_holds_nothing():
    assert resident_bytes(torch.empty(0)) == 0
