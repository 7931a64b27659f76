"""The KV manager under the hybrid layout (kv/groups.py): sliding groups return the blocks
that fall out of the window, a prefix hit needs each sliding group's window blocks, and every
block comes back exactly once."""

import pytest

from pyserve.arith import cdiv
from pyserve.kv.groups import KVGroups
from pyserve.kv.manager import KVCacheManager
from pyserve.kv.prefix import extend_block_hashes

BS = 4
WINDOW = 6
# one global group and two sliding ones, windows of 6 tokens over blocks of 4
GROUPS = KVGroups((None, WINDOW, WINDOW), ((1,), (0,), (2,)))


def manager(num_blocks=64, caching=True, order="lru") -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, order, GROUPS)


def live(kv, request_id, group):
    return [b for b in ([kv.block_ids(request_id)] + kv.group_block_ids(request_id))[group]
            if b != kv.null_block]


def decode(kv, request_id, tokens, start, end):
    """Steps one token at a time from position start to end, as the scheduler does."""
    for p in range(start, end):
        assert kv.allocate_slots(request_id, p + 1, p)
        kv.cache_full_blocks(request_id, tokens, p + 1)


def test_sliding_groups_hold_only_the_window_while_the_global_group_holds_everything():
    kv = manager(caching=False)
    tokens = list(range(100))
    assert kv.allocate_new("a", tokens[:10], 10) == (0, 10)
    decode(kv, "a", tokens, 10, 60)
    assert len(live(kv, "a", 0)) == cdiv(60, BS)
    for g in (1, 2):
        table = ([kv.block_ids("a")] + kv.group_block_ids("a"))[g]
        assert len(table) == cdiv(60, BS)
        first = (59 - WINDOW + 1) // BS  # the last query (position 59) reads keys from 54
        assert table[:first] == [kv.null_block] * first
        assert kv.null_block not in table[first:]
    held = kv.num_blocks - kv.num_free_blocks
    assert held == len(live(kv, "a", 0)) + len(live(kv, "a", 1)) + len(live(kv, "a", 2))
    assert held < 3 * cdiv(60, BS)
    kv.forget("a")
    assert kv.num_free_blocks == kv.num_blocks and kv.num_tracked_requests() == 0


def test_a_prefix_hit_takes_the_window_blocks_and_no_earlier_ones():
    kv = manager()
    prompt = list(range(1000, 1033))  # 33 tokens: 8 full blocks are cacheable
    assert kv.allocate_new("a", prompt, 64) == (0, 33)
    kv.cache_full_blocks("a", prompt, 33)
    kv.forget("a")
    cached, n = kv.allocate_new("b", prompt, 64)
    assert (cached, n) == (32, 1)
    first = (32 - WINDOW + 1) // BS  # the first computed position, 32, reads keys from 27
    for g in (1, 2):
        table = ([kv.block_ids("b")] + kv.group_block_ids("b"))[g]
        assert table[:first] == [kv.null_block] * first
        assert kv.null_block not in table[first:] and len(table) == 9
    kv.forget("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_a_hit_shrinks_to_what_every_sliding_group_still_has():
    kv = manager()
    prompt = list(range(500, 533))  # 8 cacheable blocks
    hashes = []
    extend_block_hashes(hashes, prompt, BS, 32)
    # cached content: the global group's 8 blocks, sliding group 2's 8, group 1's first 6 only
    present = {0: range(8), 1: range(6), 2: range(8)}
    blocks = kv.pool.allocate(sum(len(r) for r in present.values()))
    it = iter(blocks)
    for g, indices in present.items():
        for i in indices:
            kv.pool.cache(next(it), hashes[i] if g == 0 else hashes[i] + bytes((g,)))
    kv.pool.free(blocks)
    cached, n = kv.allocate_new("b", prompt, 64)
    # k = 8 and 7 need group 1's block 6 (keys from 27, then from 23); k = 6 needs blocks 4, 5
    assert (cached, n) == (24, 9)
    table = kv.group_block_ids("b")[0]
    lo = (24 - WINDOW + 1) // BS
    assert table[:lo] == [kv.null_block] * lo and kv.null_block not in table[lo:]
    kv.forget("b")
    assert kv.num_free_blocks == kv.num_blocks


def test_the_prompts_last_window_stays_until_the_request_ends():
    kv = manager()
    prompt = list(range(2000, 2021))  # 21 tokens: 5 cacheable blocks
    kv.allocate_new("a", prompt, 64)
    kv.cache_full_blocks("a", prompt, 21)
    tokens = prompt + list(range(60))
    decode(kv, "a", tokens, 21, 60)
    keep_from = (5 * BS - WINDOW + 1) // BS  # what a hit of the 5 blocks needs
    for g in (1, 2):
        table = ([kv.block_ids("a")] + kv.group_block_ids("a"))[g]
        assert kv.null_block not in table[keep_from:5]
        assert table[:keep_from] == [kv.null_block] * keep_from
    kv.forget("a")
    cached, _ = kv.allocate_new("b", prompt, 64)
    assert cached == 20
    kv.forget("b")
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("order", ["lru", "resident"])
def test_preemption_and_short_pools_return_every_block(order):
    kv = manager(num_blocks=12, order=order)
    tokens = list(range(64))
    assert kv.allocate_new("a", tokens[:8], 8) == (0, 8)
    assert kv.allocate_new("b", tokens[:8], 8) is not None
    ok = True
    for p in range(8, 40):
        ok = kv.allocate_slots("a", p + 1, p)
        if not ok:
            break
    assert not ok  # twelve blocks cannot hold both, even with the window freeing
    kv.free("a")
    kv.forget("b")
    kv.forget("a")
    assert kv.num_free_blocks == kv.num_blocks and kv.num_tracked_requests() == 0
