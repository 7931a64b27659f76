"""The CPU paged-attention kernel (csrc/cpu/attention.cpp) at SmolLM2-135M's shapes (9 query
heads, 3 KV heads, head size 64, blocks of 16, float32 cache): prefill chunks, decode rows
and a mix, each timed per layer and for all 30 layers, with the rate in GFLOP/s of the
causal attention it computes (2 multiply-adds per query head, key and dimension).

    python -m benchmarks.attention [--repeats 5] [--own-caches]

The default times one layer's cache again and again, so after the first pass it is read from
the CPU's caches. A served decode step instead reads 30 layers' caches, each once, from memory:
--own-caches times that (decode cases, each layer its own cache with its blocks scattered over
a pool as a served batch's are) and prints the GB/s of keys and values read, to set beside
`benchmarks.ceilings`' read bandwidth.
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


# decode batches of the peers' W2 (16 streams at up to 384 keys) and W3 (64 at 320 on average)
OWN_CACHE_CASES = [
    ("decode 16 at 384, 30 own caches", [(384, 1)] * 16),
    ("decode 64 at 320, 30 own caches", [(320, 1)] * 64),
]


def _batch(specs, gen, scatter: bool = False):
    """The batch's query, caches, block tables, starts and lengths. scatter: blocks drawn at
    random from a pool half again as large, as a served batch's lie, not one after another."""
    tables, next_block = [], 0
    for ctx, _ in specs:
        n = cdiv(ctx, BLOCK)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    pool = next_block + next_block // 2 if scatter else next_block
    if scatter:
        order = torch.randperm(pool, generator=gen)[:next_block].tolist()
        tables = [[order[b] for b in t] for t in tables]
    key_cache = torch.randn(pool, KV_HEADS, BLOCK, HEAD_SIZE, generator=gen)
    value_cache = torch.randn(pool, KV_HEADS, BLOCK, HEAD_SIZE, generator=gen)
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


def _seconds(run, repeats: int) -> float:
    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def own_caches(cases, repeats: int, layers: int = LAYERS) -> list[tuple[str, float, float]]:
    """Each case over `layers` layers with a cache of their own: the keys and values a decode
    step reads come from memory, as in a served step. Returns (case, seconds, GB read)."""
    results = []
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<36} {'all layers':>10} {'K+V read':>9} {'GB/s':>6}")
    for name, specs in cases:
        batches = [_batch(specs, gen, scatter=True) for _ in range(layers)]
        query, starts, lens = batches[0][0], batches[0][4], batches[0][5]
        out = torch.empty_like(query)

        def run():
            for _, kc, vc, tables, _, _ in batches:
                _native.paged_attention(out, query, kc, vc, tables, starts, lens, HEAD_SIZE ** -0.5)

        seconds = _seconds(run, repeats)
        read_gb = layers * 2 * sum(ctx for ctx, _ in specs) * KV_HEADS * HEAD_SIZE * 4 / 1e9
        print(f"{name:<36} {seconds * 1e3:7.1f} ms {read_gb:6.3f} GB {read_gb / seconds:6.1f}",
              flush=True)
        results.append((name, seconds, read_gb))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--own-caches", action="store_true",
                   help="decode steps over 30 layers' own caches, read from memory (GB/s)")
    args = p.parse_args(argv)
    if args.own_caches:
        own_caches(OWN_CACHE_CASES, args.repeats)
        return 0
    gen = torch.Generator().manual_seed(0)
    print(f"{'case':<36} {'per layer':>10} {'30 layers':>10} {'GFLOP/s':>8}")
    for name, specs in CASES:
        query, kc, vc, tables, starts, lens = _batch(specs, gen)
        out = torch.empty_like(query)
        seconds = _seconds(lambda: _native.paged_attention(out, query, kc, vc, tables, starts, lens,
                                                           HEAD_SIZE ** -0.5), args.repeats)
        print(f"{name:<36} {seconds * 1e3:8.2f} ms {seconds * LAYERS * 1e3:7.0f} ms "
              f"{_flops(specs) / seconds / 1e9:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
