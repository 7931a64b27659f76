"""KV-cache sizing and storage, as the start-up memory layout describes:
a block holds block_size tokens x 2 (K and V) x layers x KV heads x head size x dtype bytes,
and the number of blocks is the KV budget divided by that. Under the hybrid layout
(kv/groups.py) a block holds one group's layers, group_size of them, not every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pyserve.kv.groups import KVGroups, single_group

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


@dataclass(frozen=True)
class KVLayout:
    """What the cache needs of a model: one rank's share of its attention shapes."""

    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: torch.dtype
    groups: KVGroups | None = None  # None: one group of num_layers

    @property
    def kv_groups(self) -> KVGroups:
        return self.groups or single_group(self.num_layers)

    def bytes_per_block(self, block_size: int) -> int:
        return (2 * self.kv_groups.group_size * self.num_kv_heads * self.head_dim * block_size
                * self.dtype.itemsize)


class LayerKVCache(NamedTuple):
    """One layer's key and value caches, [num_blocks, num_kv_heads, block_size, head_dim]
    each, and the KV group whose block table its attention reads."""

    key: torch.Tensor
    value: torch.Tensor
    group: int = 0


def allocate_kv_caches(layout: KVLayout, num_blocks: int, block_size: int,
                       device: torch.device) -> list[LayerKVCache]:
    """One LayerKVCache per layer, all views of one allocation: group_size slots of num_blocks
    blocks, layer j of each group in slot j. Left uninitialised (attention reads only slots
    already written), except the null block a sliding group's freed table entries name
    (block num_blocks, kv/groups.py), which is zeroed."""
    groups = layout.kv_groups
    null = 1 if groups.frees_windows else 0
    storage_shape = (groups.group_size, 2, num_blocks + null, layout.num_kv_heads, block_size,
                     layout.head_dim)
    storage = torch.empty(storage_shape, dtype=layout.dtype, device=device)
    if null:
        storage[:, :, num_blocks].zero_()
    caches = [None] * layout.num_layers
    for g, layers in enumerate(groups.layers):
        for slot, layer in enumerate(layers):
            caches[layer] = LayerKVCache(storage[slot, 0], storage[slot, 1], g)
    return caches
