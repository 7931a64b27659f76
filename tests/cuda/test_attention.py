"""The CUDA paged-attention kernel against a few lines of plain PyTorch (float32, on the GPU,
on the same dtype-rounded inputs) and against the CPU kernel.

Tolerances: outputs are softmax-weighted means of V rows (|v| ~ 1), accumulated in float32 by
kernel and reference alike, so they differ by summation order plus the output's rounding:
float32 within 2e-5, float16 within 2e-3, bfloat16 within 1e-2 (absolute and relative; one
bfloat16 ulp at 1 is 8e-3). Cases are loops, not pytest parameters, so tools/run_cuda_tests.py
can run them without pytest."""

import math
import random

import pytest
import torch

from pyserve import _native

CUDA = torch.cuda.is_available() and _native.built_with_cuda()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of pyserve._C"),
]

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HALF = (torch.bfloat16, torch.float16)


def reference(query, keys, values, scale):
    """query [q, H, D] (the sequence's last q tokens), keys/values [ctx, Hkv, D] -> [q, H, D]."""
    q_len, ctx = query.shape[0], keys.shape[0]
    group = query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    positions = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
    scores.masked_fill_(torch.arange(ctx, device=query.device)[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class Batch:
    """specs [(context_len, query_len)] -> random caches with each sequence's blocks scattered,
    the kernel's metadata, and `pad_rows` query rows after the last sequence (padding)."""

    def __init__(self, specs, num_kv_heads, num_heads, head_size, block_size, dtype,
                 device="cuda", seed=0, pad_rows=0):
        gen = torch.Generator(device).manual_seed(seed)
        rng = random.Random(seed)
        blocks = [math.ceil(ctx / block_size) for ctx, _ in specs]
        total = sum(blocks) + 3
        shape = (total, num_kv_heads, block_size, head_size)
        self.key_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        self.value_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
        free = list(range(total))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(n)] for n in blocks]
        width = max(blocks) + 1  # wider than needed, as the runner's tables can be
        self.block_tables = torch.zeros(len(specs), width, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            self.block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        starts = [0]
        for _, q_len in specs:
            starts.append(starts[-1] + q_len)
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32)
        self.seq_lens = torch.tensor([ctx for ctx, _ in specs], dtype=torch.int32)
        self.block_tables, self.query_start_loc, self.seq_lens = (
            t.to(device) for t in (self.block_tables, self.query_start_loc, self.seq_lens))
        self.query = torch.randn(starts[-1] + pad_rows, num_heads, head_size, generator=gen,
                                 device=device).to(dtype)
        self.specs, self.starts, self.block_size, self.scale = specs, starts, block_size, head_size ** -0.5

    def run(self, query=None, out=None):
        query = self.query if query is None else query
        out = torch.full_like(query, 7.0) if out is None else out  # 7: "untouched"
        _native.paged_attention(out, query, self.key_cache, self.value_cache, self.block_tables,
                                self.query_start_loc, self.seq_lens, self.scale)
        return out

    def expected(self, query=None):
        query = self.query if query is None else query
        rows = []
        for i, (ctx, q_len) in enumerate(self.specs):
            table = torch.tensor(self.tables[i], dtype=torch.long, device=query.device)
            k = self.key_cache[table].transpose(1, 2).flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
            v = self.value_cache[table].transpose(1, 2).flatten(0, 1)[:ctx]
            q = query[self.starts[i]: self.starts[i] + q_len]
            rows.append(reference(q, k, v, self.scale) if q_len else q.float()[:0])
        return torch.cat(rows)


def assert_matches(batch, out, dtype, what):
    n = batch.starts[-1]
    tol = TOL[dtype]
    torch.testing.assert_close(out[:n].float(), batch.expected(), atol=tol, rtol=tol,
                               msg=lambda m: f"{what}: {m}")
    assert torch.all(out[n:] == 7.0), f"{what}: padding rows were written"


# A mixed batch: decodes on both sides of a block boundary, a prefill chunk with prior context,
# a whole prompt, a sequence with no rows this step. So few CTAs leave the GPU idle, so the
# kernel splits these keys as well; the next test's short contexts are never split.
MIXED = [(1, 1), (17, 1), (300, 64), (45, 45), (129, 1), (33, 0)]


def test_matches_reference_across_dtypes_head_sizes_groups_and_block_sizes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_size in (64, 128, 256):
            for num_kv_heads, group in ((4, 1), (2, 4), (1, 8)):
                for block_size in (16, 32):
                    batch = Batch(MIXED, num_kv_heads, num_kv_heads * group, head_size, block_size,
                                  dtype, pad_rows=2)
                    assert_matches(batch, batch.run(), dtype,
                                   f"{dtype} D={head_size} Hkv={num_kv_heads} G={group} bs={block_size}")


def test_prefill_rows_shared_across_sequences_and_uneven_groups():
    # Small groups put several rows in one CTA; those rows here cross sequence ends, empty
    # sequences and the padding. Groups of 3 and 6 leave slots over; 16 takes two CTAs per head.
    specs = [(37, 37), (5, 5), (60, 3), (9, 0), (20, 20), (1, 1)]
    for group in (1, 2, 3, 6, 16):
        for dtype in (torch.bfloat16, torch.float32):
            batch = Batch(specs, 2, 2 * group, 128, 16, dtype, pad_rows=5, seed=group)
            assert_matches(batch, batch.run(), dtype, f"G={group} {dtype}")


def test_long_contexts_split_the_keys():
    # At small batch the kernel spreads a context over CTAs (flash-decoding) and merges the
    # partials; mixed with a short sequence whose later splits hold no keys.
    cases = [
        ([(4096, 1)], 8, 4, 128), ([(16384, 1)], 8, 4, 128), ([(16384, 1)], 8, 8, 128),
        ([(4096, 1)] * 4, 8, 4, 128), ([(16384, 1), (100, 1), (4096, 1)], 2, 8, 64),
        ([(4000, 7), (4096, 1)], 4, 4, 256), ([(16384, 1)], 1, 8, 256),
    ]
    for specs, num_kv_heads, group, head_size in cases:
        for dtype in (torch.bfloat16, torch.float16):
            for block_size in (16, 32):
                batch = Batch(specs, num_kv_heads, num_kv_heads * group, head_size, block_size, dtype)
                assert_matches(batch, batch.run(), dtype,
                               f"{specs} Hkv={num_kv_heads} G={group} D={head_size} bs={block_size}")


def test_strided_and_unaligned_queries_and_outputs():
    batch = Batch(MIXED, 2, 8, 128, 16, torch.bfloat16)
    n, heads, d = batch.query.shape
    # q as the kernel gets it from a fused qkv projection: rows 12 heads apart.
    qkv = torch.randn(n, 12 * d, device="cuda").to(torch.bfloat16)
    q = qkv[:, : heads * d].view(n, heads, d)
    q.copy_(batch.query)
    wide_out = torch.full((n, heads, 2 * d), 7.0, device="cuda", dtype=torch.bfloat16)
    out = batch.run(q, wide_out[:, :, :d])
    assert_matches(batch, out, torch.bfloat16, "strided")
    assert torch.all(wide_out[:, :, d:] == 7.0)
    # A query one element off 16-byte alignment is copied, not misread.
    flat = torch.empty(batch.query.numel() + 1, device="cuda", dtype=torch.bfloat16)
    q = flat[1:].view_as(batch.query)
    q.copy_(batch.query)
    assert_matches(batch, batch.run(q), torch.bfloat16, "unaligned")


def test_cuda_matches_cpu_kernel():
    # The same float32 data through both kernels: a mixed batch, and a long decode that splits.
    for specs, num_kv_heads, group, head_size, block_size in (
        (MIXED, 2, 4, 128, 16), (MIXED, 1, 8, 64, 32), ([(4096, 1), (300, 20), (2000, 1)], 8, 4, 128, 16),
    ):
        batch = Batch(specs, num_kv_heads, num_kv_heads * group, head_size, block_size, torch.float32,
                      pad_rows=1)
        cpu_out = torch.full_like(batch.query, 7.0, device="cpu")
        _native.paged_attention(cpu_out, batch.query.cpu(), batch.key_cache.cpu(), batch.value_cache.cpu(),
                                batch.block_tables.cpu(), batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.scale)
        torch.testing.assert_close(batch.run().cpu(), cpu_out, atol=2e-5, rtol=1e-5)


def test_sliding_window_and_softcap_match_cpu_kernel():
    # Gemma's local layers and Gemma 2's scores: the CPU kernel (tests/kernels/
    # test_sliding_window.py checks it against PyTorch) on the same float32 data. The long
    # decode splits, and most of its splits lie wholly below the window.
    for specs, window, softcap, head_size in (
        (MIXED, 8, 0.0, 128), (MIXED, 40, 50.0, 256), ([(4096, 1), (300, 20), (2000, 1)], 100, 0.0, 64),
        (MIXED, 0, 5.0, 64),
    ):
        batch = Batch(specs, 2, 8, head_size, 16, torch.float32, pad_rows=1)
        cpu_out = torch.full_like(batch.query, 7.0, device="cpu")
        _native.paged_attention(cpu_out, batch.query.cpu(), batch.key_cache.cpu(), batch.value_cache.cpu(),
                                batch.block_tables.cpu(), batch.query_start_loc.cpu(), batch.seq_lens.cpu(),
                                batch.scale, window, softcap)
        out = torch.full_like(batch.query, 7.0)
        _native.paged_attention(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                batch.query_start_loc, batch.seq_lens, batch.scale, window, softcap)
        torch.testing.assert_close(out.cpu(), cpu_out, atol=2e-5, rtol=1e-5)


def test_rejects_unsupported_head_size_and_mixed_devices():
    batch = Batch([(10, 1)], 1, 4, 64, 16, torch.float32)
    q96 = torch.zeros(1, 4, 96, device="cuda")
    cache96 = torch.zeros(4, 1, 16, 96, device="cuda")
    with pytest.raises(RuntimeError, match="head sizes 64, 128 and 256"):
        _native.paged_attention(torch.empty_like(q96), q96, cache96, cache96, batch.block_tables,
                                batch.query_start_loc, batch.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="one device"):
        _native.paged_attention(torch.empty_like(batch.query), batch.query, batch.key_cache,
                                batch.value_cache, batch.block_tables.cpu(), batch.query_start_loc,
                                batch.seq_lens, 1.0)


def test_reshape_and_cache_takes_key_and_value_with_different_strides():
    # As the model calls it: k fresh from the rotary embedding, v a view of the qkv projection.
    gen = torch.Generator("cuda").manual_seed(5)
    tokens, heads, d, blocks, block_size = 45, 2, 128, 8, 16
    for dtype in (torch.bfloat16, torch.float32):
        qkv = torch.randn(tokens, 12 * d, generator=gen, device="cuda").to(dtype)
        key = qkv[:, 8 * d: 10 * d].view(tokens, heads, d).contiguous()
        value = qkv[:, 10 * d:].view(tokens, heads, d)
        slots = torch.randperm(blocks * block_size, generator=gen, device="cuda")[:tokens]
        slots[7] = -1  # padding
        caches = [torch.zeros(blocks, heads, block_size, d, dtype=dtype, device="cuda") for _ in range(2)]
        _native.reshape_and_cache(key, value, caches[0], caches[1], slots)
        expected = [torch.zeros(blocks, heads, block_size, d, dtype=dtype) for _ in range(2)]
        _native.reshape_and_cache(key.cpu(), value.cpu(), expected[0], expected[1], slots.cpu())
        assert torch.equal(caches[0].cpu(), expected[0]) and torch.equal(caches[1].cpu(), expected[1])
