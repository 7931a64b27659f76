"""KV-cache sizing and storage, as the start-up memory layout describes:
a block holds block_size tokens x 2 (K and V) x layers x KV heads x head size x dtype bytes,
and the number of blocks is the KV budget divided by that."""

from __future__ import annotations

import torch

from pyserve.model.arch import ModelArch

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


def bytes_per_block(arch: ModelArch, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * num_kv_heads * arch.head_dim * block_size * dtype.itemsize


def allocate_kv_caches(arch: ModelArch, num_kv_heads: int, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One [num_blocks, num_kv_heads, block_size, head_dim] key and value tensor per layer, all
    views of one allocation. Left uninitialised: attention reads only slots already written."""
    storage = torch.empty(arch.num_layers, 2, num_blocks, num_kv_heads, block_size, arch.head_dim,
                          dtype=dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(arch.num_layers)]
