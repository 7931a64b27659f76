"""The state pool's bookkeeping (kv/state.py): rows taken and given back once, steps cut at
checkpoint boundaries, checkpoints written at those boundaries and found again by the hash
of the block that ends there, held while read, evicted least recently used."""

from pyserve.kv.state import StatePool

HASHES = [bytes([i]) * 4 for i in range(10)]  # stand-ins for ten blocks' chained hashes


def test_rows_are_taken_once_and_given_back():
    pool = StatePool(2, 0, 16, 64)
    assert pool.take_slot("a") and pool.take_slot("a") and pool.take_slot("b")
    assert not pool.take_slot("c") and pool.num_free_slots == 0
    assert {pool.slot("a"), pool.slot("b")} == {0, 1}
    pool.free("a")
    assert pool.take_slot("c") and pool.num_free_slots == 0
    pool.free("b"), pool.free("c"), pool.free("c")
    assert pool.num_free_slots == 2 and not pool.tracked()


def test_steps_end_on_checkpoint_boundaries():
    pool = StatePool(1, 1, 16, 64)
    assert pool.cut(0, 128, 200) == 64  # every 64 tokens
    assert pool.cut(64, 128, 200) == 64
    assert pool.cut(128, 100, 200) == 64  # 192: also the last full block before the last token
    assert pool.cut(150, 40, 170) == 10  # 160: the prompt's last full block
    assert pool.cut(192, 8, 200) == 8  # nothing inside
    assert pool.cut(10, 1, 11) == 1  # a decode step is never cut
    assert StatePool(1, 0, 16, 64).cut(0, 128, 200) == 128  # no checkpoints, no cuts


def test_checkpoints_are_written_at_boundaries_found_by_hash_and_held_while_read():
    pool = StatePool(2, 2, 16, 32)
    pool.take_slot("a")
    assert pool.target_row("a", 20, HASHES[:5]) == -1  # not on a block boundary
    assert pool.target_row("a", 48, HASHES[:5]) == -1  # neither every 32 tokens nor the last block
    row = pool.target_row("a", 32, HASHES[:5])
    assert row >= pool.num_slots  # a checkpoint row, after the running rows
    assert pool.checkpointed(HASHES, 5) == (0, -1)  # registered only once its step ran
    pool.ran("a")
    assert pool.num_checkpoints_kept == 1
    assert pool.target_row("a", 32, HASHES[:5]) == -1  # that prefix has one already
    k, checkpoint = pool.checkpointed(HASHES, 5)
    assert k == 2 and pool.num_slots + checkpoint == row
    pool.take_slot("b")
    pool.resume_from("b", checkpoint)
    assert pool.source_row("b") == row and pool.num_checkpoints_held == 1
    pool.ran("b")  # read: released, still kept
    assert pool.source_row("b") == -1 and pool.num_checkpoints_held == 0 and pool.num_checkpoints_kept == 1
    pool.free("a"), pool.free("b")
    assert not pool.tracked()


def test_the_least_recently_used_checkpoint_is_evicted():
    pool = StatePool(1, 2, 16, 16)
    pool.take_slot("a")
    for end in (16, 32, 48):  # three checkpoints, two rows
        assert pool.target_row("a", end, HASHES) >= 0
        pool.ran("a")
    assert pool.checkpointed(HASHES, 1) == (0, -1)  # the first one went
    assert pool.checkpointed(HASHES, 3)[0] == 3 and pool.checkpointed(HASHES, 2)[0] == 2


def test_a_request_freed_before_its_step_ran_registers_nothing():
    pool = StatePool(1, 1, 16, 16)
    pool.take_slot("a")
    assert pool.target_row("a", 16, HASHES) >= 0
    pool.free("a")  # preempted or aborted
    assert pool.checkpointed(HASHES, 1) == (0, -1) and pool.num_checkpoints_held == 0
