"""A bfloat16, float16 or float8 e5m2 KV cache under float32 activations (--kv-cache-dtype): keys and
values are rounded as torch rounds them when written, and attention over the narrow cache is
bitwise attention over a float32 cache holding the rounded values, on every path (decode
rows, verify rows, prefill tiles, the plain loop, windows and softcapping)."""

import pytest
import torch

from pyserve import _native
from tests.kernels.test_attention import make_batch

NARROW = [torch.bfloat16, torch.float16, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", NARROW)
def test_the_cache_holds_keys_rounded_as_torch_rounds_them(cache_dtype):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, d, block_size, blocks = 45, 2, 64, 16, 6
    # values near the narrow types' rounding ties and limits, besides ordinary ones
    key = torch.randn(tokens, heads, d, generator=gen) * torch.logspace(-6, 4, d)
    value = torch.randn(tokens, heads, d, generator=gen)
    value[0, 0, :6] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, -(1 + 3 * 2**-11), 1 + 2**-3,
                                    -(1 + 3 * 2**-3)])
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    kc = torch.zeros(blocks, heads, block_size, d, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    _native.reshape_and_cache(key, value, kc, vc, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(kc[s // block_size, :, s % block_size], key[t].to(cache_dtype))
        assert torch.equal(vc[s // block_size, :, s % block_size], value[t].to(cache_dtype))


# (context_len, query_len): decode rows, a verify step's rows, prefill chunks long enough for
# the tile path, all in one batch
SPECS = [(1, 1), (40, 1), (100, 1), (70, 5), (129, 17), (48, 48), (160, 40)]


@pytest.mark.parametrize("cache_dtype", NARROW)
@pytest.mark.parametrize("head_size,num_kv_heads,group", [(64, 3, 3), (128, 2, 4), (256, 1, 4), (96, 2, 2)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (32, 0.0), (50, 30.0)])
def test_attention_over_a_narrow_cache_is_attention_over_its_values(cache_dtype, head_size, num_kv_heads,
                                                                    group, window, softcap):
    narrow_k, narrow_v, tables, _ = make_batch(SPECS, num_kv_heads, head_size, 16, torch.float32, seed=5)
    narrow_k, narrow_v = narrow_k.to(cache_dtype), narrow_v.to(cache_dtype)
    wide_k, wide_v = narrow_k.float(), narrow_v.float()
    query = torch.randn(sum(q for _, q in SPECS), num_kv_heads * group, head_size,
                        generator=torch.Generator().manual_seed(9))
    starts = torch.tensor([0] + [sum(q for _, q in SPECS[: i + 1]) for i in range(len(SPECS))],
                          dtype=torch.int32)
    lens = torch.tensor([c for c, _ in SPECS], dtype=torch.int32)
    out, expected = torch.empty_like(query), torch.empty_like(query)
    _native.paged_attention(out, query, narrow_k, narrow_v, tables, starts, lens, head_size ** -0.5,
                            window, softcap)
    _native.paged_attention(expected, query, wide_k, wide_v, tables, starts, lens, head_size ** -0.5,
                            window, softcap)
    assert torch.equal(out, expected)


def test_mismatched_cache_dtypes_are_refused():
    k, v, tables, _ = make_batch([(20, 1)], 1, 64, 16, torch.float32)
    query = torch.randn(1, 2, 64)
    starts, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="caches"):  # a narrow query over a float32 cache
        _native.paged_attention(torch.empty_like(query).bfloat16(), query.bfloat16(), k, v, tables,
                                starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="caches"):  # K and V caches of two dtypes
        _native.paged_attention(torch.empty_like(query), query, k.bfloat16(), v.half(), tables,
                                starts, lens, 0.125)
    with pytest.raises(RuntimeError, match="caches"):
        _native.reshape_and_cache(torch.randn(1, 1, 64).bfloat16(), torch.randn(1, 1, 64).bfloat16(),
                                  k, v, torch.tensor([3]))
