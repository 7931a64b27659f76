"""KV-cache sizing and storage, as the start-up memory layout describes:
a block holds block_size tokens x 2 (K and V) x layers x KV heads x head size x dtype bytes,
and the number of blocks is the KV budget divided by that."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class KVLayout:
    """What the cache needs of a model: one rank's share of its attention shapes."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * block_size * self.dtype.itemsize


def allocate_kv_caches(layout: KVLayout, num_blocks: int, block_size: int,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One [num_blocks, num_kv_heads, block_size, head_dim] key and value tensor per layer, all
    views of one allocation. Left uninitialised: attention reads only slots already written."""
    storage = torch.empty(layout.num_layers, 2, num_blocks, layout.num_kv_heads, block_size,
                          layout.head_dim, dtype=layout.dtype, device=device)
    return [(storage[i, 0], storage[i, 1]) for i in range(layout.num_layers)]
