import pytest

from pyserve import _native


def test_allocate_takes_oldest_free_first_and_free_appends():
    pool = _native.BlockPool(6)
    assert pool.num_blocks == 6 and pool.num_free == 6
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3] and pool.num_free == 2
    pool.free([3, 1])
    # LRU order: never-used 4, 5 first, then 3 and 1 in the order they were released
    assert pool.free_queue() == [4, 5, 3, 1]
    assert pool.allocate(3) == [4, 5, 3]


def test_ref_counts_and_sharing():
    pool = _native.BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and b not in pool.free_queue()
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.free_queue()[-1] == b


def test_errors_change_nothing():
    pool = _native.BlockPool(3)
    ids = pool.allocate(2)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(2)
    assert pool.num_free == 1
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([ids[0], ids[0]])
    assert pool.ref_count(ids[0]) == 1
    pool.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([ids[1]])
    with pytest.raises(IndexError):
        pool.free([7])
    with pytest.raises(RuntimeError, match="incref of free"):
        pool.incref([ids[0]])
    assert pool.num_free == 3
    with pytest.raises(ValueError):
        _native.BlockPool(0)


def test_prefix_cache_entries_survive_free_until_reuse():
    pool = _native.BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h-a") and pool.cache(b, b"h-b")
    assert not pool.cache(pool.allocate(1)[0], b"h-a")  # same content already cached
    assert pool.lookup(b"h-a") == a and pool.lookup(b"nope") == -1
    pool.free([b, a])
    assert pool.num_cached == 2 and pool.num_free == 2
    # A hit takes the block back out of the free queue.
    pool.acquire([a])
    assert pool.ref_count(a) == 1 and pool.free_queue() == [b]
    # Reusing a free cached block for new content evicts its entry.
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"h-b") == -1 and pool.num_evictions == 1
    with pytest.raises(RuntimeError, match="not cached"):
        pool.acquire([b])
    with pytest.raises(RuntimeError, match="cannot cache free"):
        pool.free([b])
        pool.cache(b, b"h-c")


def test_resident_order_reuses_written_blocks_before_unused_ones():
    pool = _native.BlockPool(6, "resident")
    assert pool.num_free == 6 and pool.free_queue() == [0, 1, 2, 3, 4, 5] and pool.num_touched == 0
    assert pool.allocate(4) == [0, 1, 2, 3] and pool.num_touched == 4
    pool.free([3, 1])
    # released blocks first, in release order, then the never-used ones
    assert pool.free_queue() == [3, 1, 4, 5] and pool.num_free == 4
    assert pool.allocate(3) == [3, 1, 4] and pool.num_touched == 5
    assert pool.free_queue() == [5]


def test_resident_order_evicts_cached_content_before_using_new_memory():
    pool = _native.BlockPool(4, "resident")
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h-a") and pool.cache(b, b"h-b")
    pool.free([b, a])
    assert pool.allocate(1) == [b]  # the least recently freed cached block, not block 2
    assert pool.lookup(b"h-b") == -1 and pool.lookup(b"h-a") == a and pool.num_evictions == 1
    pool.acquire([a])
    assert pool.allocate(2) == [2, 3] and pool.num_free == 0 and pool.num_touched == 4
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        pool.allocate(1)


def test_unknown_block_order_is_refused():
    with pytest.raises(ValueError, match="'lru' or 'resident'"):
        _native.BlockPool(4, "fifo")
