"""The CPU cache-write and paged-attention kernels against plain PyTorch.

Tolerances: float32 within 2e-5 absolute (the kernel and the reference sum in different
orders); bfloat16 / float16 within one to two ulps of the output scale (2e-2 / 4e-3), since
both accumulate in float32 but round inputs and outputs to 8 or 11 mantissa bits."""

import math
import random

import pytest
import torch

from pyserve import _native

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference_attention(query, keys, values, q_len, scale):
    """query [q, H, D] (the last q tokens), keys/values [ctx, Hkv, D] -> [q, H, D]."""
    ctx, num_kv_heads = keys.shape[0], keys.shape[1]
    group = query.shape[1] // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    positions = torch.arange(ctx - q_len, ctx)[:, None]
    mask = torch.arange(ctx)[None, :] > positions  # causal: row i sees keys 0..ctx-q_len+i
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_batch(seq_specs, num_kv_heads, head_size, block_size, dtype, seed=0):
    """seq_specs: [(context_len, query_len)]. Returns everything the kernels take, with each
    sequence's K/V written through reshape_and_cache into randomly placed blocks."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    total_blocks = sum(math.ceil(c / block_size) for c, _ in seq_specs) + 3
    key_cache = torch.zeros(total_blocks, num_kv_heads, block_size, head_size, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = list(range(total_blocks))
    rng.shuffle(free)
    tables, per_seq_kv = [], []
    for ctx, _ in seq_specs:
        blocks = [free.pop() for _ in range(math.ceil(ctx / block_size))]
        tables.append(blocks)
        k = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(ctx)])
        _native.reshape_and_cache(k, v, key_cache, value_cache, slots)
        per_seq_kv.append((k, v))
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(seq_specs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return key_cache, value_cache, block_tables, per_seq_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_each_slot(dtype, block_size):
    gen = torch.Generator().manual_seed(1)
    num_tokens, heads, d, num_blocks = 37, 3, 64, 8
    key = torch.randn(num_tokens, heads, d, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, d, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1  # padding: skipped
    kc = torch.zeros(num_blocks, heads, block_size, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    _native.reshape_and_cache(key, value, kc, vc, slots)
    expect_k, expect_v = torch.zeros_like(kc), torch.zeros_like(vc)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // block_size, :, s % block_size] = key[t]
            expect_v[s // block_size, :, s % block_size] = value[t]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


# (context_len, query_len) per sequence: decodes, whole prompts and chunks of prompts, with
# lengths on, just under and just over block boundaries.
BATCHES = {
    "decode": [(1, 1), (15, 1), (16, 1), (17, 1), (100, 1)],
    "prefill": [(1, 1), (31, 31), (33, 33), (64, 64)],
    "mixed": [(40, 1), (48, 48), (70, 21), (5, 1), (129, 17), (16, 16)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_kv_heads,group", [(4, 1), (2, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_paged_attention_matches_reference(dtype, block_size, head_size, num_kv_heads, group, batch):
    specs = BATCHES[batch]
    num_heads = num_kv_heads * group
    key_cache, value_cache, block_tables, kv = make_batch(
        specs, num_kv_heads, head_size, block_size, dtype, seed=head_size + group)
    gen = torch.Generator().manual_seed(7)
    total_q = sum(q for _, q in specs)
    query = torch.randn(total_q, num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0] + [sum(q for _, q in specs[: i + 1]) for i in range(len(specs))],
                          dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in specs], dtype=torch.int32)
    scale = head_size ** -0.5
    out = torch.empty_like(query)
    _native.paged_attention(out, query, key_cache, value_cache, block_tables, starts, seq_lens, scale)
    for i, (ctx, q_len) in enumerate(specs):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = reference_attention(query[rows], kv[i][0], kv[i][1], q_len, scale)
        torch.testing.assert_close(out[rows].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [256, 96])  # the widest SIMD path; a size only the plain loop takes
def test_paged_attention_other_head_sizes(dtype, head_size):
    specs = BATCHES["mixed"]
    key_cache, value_cache, block_tables, kv = make_batch(specs, 2, head_size, 16, dtype, seed=3)
    query = torch.randn(sum(q for _, q in specs), 6, head_size).to(dtype)
    starts = torch.tensor([0] + [sum(q for _, q in specs[: i + 1]) for i in range(len(specs))],
                          dtype=torch.int32)
    out = torch.empty_like(query)
    _native.paged_attention(out, query, key_cache, value_cache, block_tables, starts,
                            torch.tensor([c for c, _ in specs], dtype=torch.int32), head_size ** -0.5)
    for i, (ctx, q_len) in enumerate(specs):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        expected = reference_attention(query[rows], kv[i][0], kv[i][1], q_len, head_size ** -0.5)
        torch.testing.assert_close(out[rows].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_attention_is_exact_for_one_key_and_large_score_gaps():
    """Softmax weights below e^-87 (where the kernel's exponential clamps) and a context of one
    key (weight exactly 1) both give the reference's output."""
    specs = [(1, 1), (40, 1)]
    kc, vc, tables, kv = make_batch(specs, 1, 64, 16, torch.float32, seed=5)
    query = torch.randn(2, 2, 64) * 40  # scores spread over hundreds
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    out = torch.empty_like(query)
    _native.paged_attention(out, query, kc, vc, tables, starts, torch.tensor([1, 40], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out[0], kv[0][1][0].expand(2, 64), atol=0, rtol=0)
    torch.testing.assert_close(out[1:], reference_attention(query[1:], *kv[1], 1, 0.125), atol=2e-5, rtol=2e-5)


def test_paged_attention_accepts_strided_query():
    """The model hands q as a view into the fused qkv projection."""
    specs = [(20, 4)]
    kc, vc, tables, kv = make_batch(specs, 2, 64, 16, torch.float32)
    qkv = torch.randn(4, (4 + 2 + 2) * 64)
    query = qkv[:, : 4 * 64].view(4, 4, 64)
    assert not query.is_contiguous()
    out = torch.empty(4, 4, 64)
    _native.paged_attention(out, query, kc, vc, tables, torch.tensor([0, 4], dtype=torch.int32),
                            torch.tensor([20], dtype=torch.int32), 0.125)
    torch.testing.assert_close(out, reference_attention(query, *kv[0], 4, 0.125), atol=2e-5, rtol=2e-5)


def test_paged_attention_rejects_bad_metadata():
    kc, vc, tables, _ = make_batch([(20, 4)], 2, 64, 16, torch.float32)
    query = torch.randn(4, 4, 64)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="shorter than its query"):
        _native.paged_attention(out, query, kc, vc, tables, torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="block_tables too narrow"):
        _native.paged_attention(out, query, kc, vc, tables, torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([200], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        _native.paged_attention(out, query, kc, vc, tables.long(), torch.tensor([0, 4], dtype=torch.int32),
                                torch.tensor([20], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("q_len", [2, 5, 17])  # verify steps: 1 + 1 .. 16 drafts
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (1, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verify_steps_rows_are_bitwise_their_decode_steps(q_len, num_kv_heads, group, dtype):
    """A speculative verify step puts 1 + k rows of one sequence in the batch; each row's output
    must be bitwise what a decode step (one row, the context through its position) computes,
    beside other sequences' rows, or a draft could be judged against logits that differ from
    plain decoding's (the AVX-512 tile path for prefill chunks sums in another order)."""
    head_size, block_size = 64, 16
    specs = [(150, q_len), (40, 1), (70, 30)]  # the verify rows, a decode row, a prefill chunk
    num_heads = num_kv_heads * group
    key_cache, value_cache, block_tables, _ = make_batch(specs, num_kv_heads, head_size, block_size,
                                                         dtype, seed=q_len)
    gen = torch.Generator().manual_seed(q_len)
    query = torch.randn(q_len + 31, num_heads, head_size, generator=gen).to(dtype)
    starts = torch.tensor([0, q_len, q_len + 1, q_len + 31], dtype=torch.int32)
    seq_lens = torch.tensor([c for c, _ in specs], dtype=torch.int32)
    out = torch.empty_like(query)
    _native.paged_attention(out, query, key_cache, value_cache, block_tables, starts, seq_lens, 0.125)
    for r in range(q_len):
        alone = torch.empty(1, num_heads, head_size, dtype=dtype)
        context = torch.tensor([150 - q_len + r + 1], dtype=torch.int32)
        _native.paged_attention(alone, query[r:r + 1].contiguous(), key_cache, value_cache,
                                block_tables[:1], torch.tensor([0, 1], dtype=torch.int32), context, 0.125)
        assert torch.equal(out[r], alone[0]), r


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (40, 30.0)])
@pytest.mark.parametrize("num_kv_heads,group,head_size", [(1, 4, 256), (3, 3, 64)])  # Gemma 3 270M, SmolLM2
def test_a_lone_rows_heads_split_over_threads_change_no_bit(window, softcap, num_kv_heads, group, head_size):
    """A decode row of a model with one KV head (Gemma 3 270M: 4 query heads of 256) or three
    (SmolLM2) is too few work items for two threads to share evenly, so the kernel splits each
    KV head's query heads into runs, one per thread; each head must come out bitwise as when
    the row shares a batch with others and is not split."""
    block_size = 16
    specs = [(300, 1), (90, 1), (120, 1), (200, 1)]
    key_cache, value_cache, block_tables, _ = make_batch(specs, num_kv_heads, head_size, block_size,
                                                         torch.float32)
    query = torch.randn(4, num_kv_heads * group, head_size, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch = torch.empty_like(query)
        _native.paged_attention(batch, query, key_cache, value_cache, block_tables,
                                torch.arange(5, dtype=torch.int32), torch.tensor([c for c, _ in specs], dtype=torch.int32),
                                head_size ** -0.5, window, softcap)
        alone = torch.empty(1, num_kv_heads * group, head_size)
        _native.paged_attention(alone, query[:1].contiguous(), key_cache, value_cache, block_tables[:1],
                                torch.tensor([0, 1], dtype=torch.int32), torch.tensor([300], dtype=torch.int32),
                                head_size ** -0.5, window, softcap)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone[0], batch[0])
