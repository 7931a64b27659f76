"""The hybrid KV layout's groups (kv/groups.py): which layers share a block, and how many
blocks a sequence holds at most."""

from pyserve.arith import cdiv
from pyserve.kv.cache import KVLayout, allocate_kv_caches
from pyserve.kv.groups import MAX_GROUPS, plan_kv_groups, sequence_blocks

import torch


def gemma3_windows(num_layers: int, window: int = 512) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_270m_pattern_makes_one_global_group_and_five_sliding_ones():
    groups = plan_kv_groups(gemma3_windows(18), max_model_len=32768)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17)
    assert sorted(l for g in groups.layers for l in g) == list(range(18))
    assert groups.group_size == 3 and groups.frees_windows
    assert groups.place(17) == (0, 2) and groups.place(0) == (1, 0)


def test_uneven_counts_leave_slots_of_the_last_group_unused():
    groups = plan_kv_groups(gemma3_windows(26), max_model_len=32768)  # Gemma 3 1B: 4 global
    assert groups.group_size == 4
    assert [len(g) for g in groups.layers] == [4, 4, 4, 4, 4, 4, 2]


def test_one_plain_group_when_nothing_would_ever_be_freed_or_when_disabled():
    assert plan_kv_groups([None] * 4, 4096).windows == (None,)
    assert plan_kv_groups(gemma3_windows(12, 4096), max_model_len=4096).windows == (None,)
    assert plan_kv_groups(gemma3_windows(12), 4096, enabled=False).windows == (None,)
    mistral = plan_kv_groups([8] * 4, 64)  # every layer slides: one sliding group
    assert mistral.windows == (8,) and mistral.layers == ((0, 1, 2, 3),)


def test_too_many_groups_fall_back_to_one():
    windows = [8] + [None] * (MAX_GROUPS + 2)  # one sliding layer: groups of one layer each
    assert plan_kv_groups(windows, 64).num_groups == 1


def test_blocks_for_sequence_counts_the_window_and_a_chunk_in_sliding_groups():
    groups = plan_kv_groups(gemma3_windows(18), max_model_len=32768)
    assert groups.blocks_for_sequence(4096, 16, 128) == 256 + 5 * (cdiv(512 + 128, 16) + 1)
    assert groups.blocks_for_sequence(100, 16, 128) == 6 * cdiv(100, 16)  # within the window
    assert sequence_blocks(groups, 4096, 16, 128) == groups.blocks_for_sequence(4096, 16, 128)
    assert sequence_blocks(None, 4096, 16, 128) == 256  # the plain layout


def test_caches_put_each_group_in_its_slots_and_zero_the_null_block():
    groups = plan_kv_groups(gemma3_windows(6, 8), max_model_len=64)
    layout = KVLayout(6, 1, 4, torch.float32, groups)
    assert layout.bytes_per_block(16) == 2 * 1 * 1 * 4 * 16 * 4  # one layer per block slot
    caches = allocate_kv_caches(layout, 10, 16, torch.device("cpu"))
    assert [c.group for c in caches] == [groups.place(i)[0] for i in range(6)]
    for c in caches:
        assert c.key.shape == (11, 1, 16, 4)  # the null block past the pool's 10
        assert not c.key[10].any() and not c.value[10].any()
    # layers of different groups in the same slot share memory, block by block
    first, other = caches[groups.layers[0][0]], caches[groups.layers[1][0]]
    assert first.key.data_ptr() == other.key.data_ptr()
