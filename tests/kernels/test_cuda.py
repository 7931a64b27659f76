"""The CUDA kernels against their CPU twins (the reference). Needs a CUDA device and a
CUDA build of pyserve._C; skipped otherwise."""

import pytest
import torch

from pyserve import _native

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and _native.built_with_cuda()),
                       reason="needs a CUDA device and a CUDA build of pyserve._C"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 32)])
def test_reshape_and_cache_matches_cpu(dtype, head_size, block_size):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, blocks = 50, 4, 8
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[3] = -1
    caches = [torch.zeros(blocks, heads, block_size, head_size, dtype=dtype) for _ in range(2)]
    _native.reshape_and_cache(key, value, caches[0], caches[1], slots)
    gpu = [c.cuda() * 0 for c in caches]
    _native.reshape_and_cache(key.cuda(), value.cuda(), gpu[0], gpu[1], slots.cuda())
    torch.cuda.synchronize()
    assert torch.equal(gpu[0].cpu(), caches[0]) and torch.equal(gpu[1].cpu(), caches[1])
