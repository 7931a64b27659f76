"""The CPU paged-attention kernel (csrc/cpu/attention.cpp) at SmolLM2-135M's shapes (9 query
heads, 3 KV heads, head size 64, blocks of 16, float32 cache): prefill chunks, decode rows
and a mix, each timed per layer and for all 30 layers, with the rate in GFLOP/s of the
causal attention it computes (2 multiply-adds per query head, key and dimension).

    python -m benchmarks.attention [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from pyserve.arith import cdiv
from pyserve import _native

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16
LAYERS = 30
# (name, [(context_len, query_len)] per sequence)
CASES = [
    ("prefill 8 x 256", [(256, 256)] * 8),
    ("prefill 1 x 2048", [(2048, 2048)]),
    ("suffixes 8 x 64 after 1024 cached", [(1088, 64)] * 8),
    ("decode 16 at 384", [(384, 1)] * 16),
    ("decode 1 at 2048", [(2048, 1)]),
]


def _batch(specs, gen):
    tables, next_block = [], 0
    for ctx, _ in specs:
        n = cdiv(ctx, BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    key_cache = torch.randn(next_block, KV_HEADS, BLOCK, HEAD_SIZE, generator=gen)
    value_cache = torch.randn(next_block, KV_HEADS, BLOCK, HEAD_SIZE, generator=gen)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(specs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for _, q in specs:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], HEADS, HEAD_SIZE, generator=gen)
    seq_lens = torch.tensor([c for c, _ in specs], dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, torch.tensor(starts, dtype=torch.int32), seq_lens


def _flops(specs) -> float:
    # each query row at position p sees p + 1 keys; QK and PV are HEAD_SIZE multiply-adds each
    keys = sum(sum(ctx - q + i + 1 for i in range(q)) for ctx, q in specs)
    return keys * HEADS * HEAD_SIZE * 2 * 2


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<36} {'per layer':>10} {'30 layers':>10} {'GFLOP/s':>8}")
    for name, specs in CASES:
        query, kc, vc, tables, starts, lens = _batch(specs, gen)
        out = torch.empty_like(query)
        run = lambda: _native.paged_attention(out, query, kc, vc, tables, starts, lens, HEAD_SIZE ** -0.5)
        run()
        start = time.perf_counter()
        for _ in range(args.repeats):
            run()
        seconds = (time.perf_counter() - start) / args.repeats
        print(f"{name:<36} {seconds * 1e3:8.2f} ms {seconds * LAYERS * 1e3:7.0f} ms "
              f"{_flops(specs) / seconds / 1e9:8.1f}", flush=True)


if __name__ == "__main__":
    main()
