"""benchmarks/attention.py: --own-caches reads each layer's own, scattered cache."""

import torch

from benchmarks import attention


def test_scattered_blocks_are_distinct_and_inside_the_pool():
    gen = torch.Generator().manual_seed(0)
    specs = [(40, 1), (17, 1), (16, 1)]  # 3, 2 and 1 blocks of 16
    _, key_cache, value_cache, tables, _, lens = attention._batch(specs, gen, scatter=True)
    used = [int(b) for row, (ctx, _) in zip(tables, specs)
            for b in row[: -(-ctx // attention.BLOCK)]]
    assert len(used) == len(set(used)) == 6
    assert key_cache.shape[0] == value_cache.shape[0] == 9 and all(0 <= b < 9 for b in used)
    assert used != list(range(6))  # drawn from the pool, not laid one after another
    assert lens.tolist() == [40, 17, 16]


def test_own_caches_reports_the_bytes_each_step_reads(capsys):
    [(name, seconds, read_gb)] = attention.own_caches([("two decode rows", [(48, 1), (20, 1)])],
                                                      repeats=1, layers=2)
    # keys and values of 48 + 20 positions, 3 KV heads of 64 float32 each, in 2 layers
    assert read_gb == 2 * 2 * 68 * 3 * 64 * 4 / 1e9 and seconds > 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].startswith(name)
