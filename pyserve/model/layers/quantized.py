"""GGUF-quantized weights kept quantized: a checkpoint tensor's raw blocks travel through the
layers' ordinary weight loaders (column, row and vocabulary shards alike) into a block buffer
beside the layer's float parameter, which then stays empty; pack_for_cpu packs the buffer for
the CPU kernel. Blocks hold 32 consecutive inputs of one output row, so output rows split
anywhere and inputs split on multiples of 32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve.errors import ModelLoadError

# GGUF types the CPU kernel reads directly -> bytes per block of 32 weights
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
BLOCK = 32


@dataclass
class GGUFBlocks:
    """A checkpoint tensor [rows, cols] as raw GGUF blocks [rows, cols / 32 * block bytes]."""

    type: str
    blocks: torch.Tensor  # uint8
    shape: tuple[int, int]

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.type, self.blocks.narrow(0, start, length), (length, self.shape[1]))
        if start % BLOCK or length % BLOCK:
            raise ModelLoadError(f"a {self.type} tensor splits its inputs only on multiples of "
                                 f"{BLOCK}, not at {start} + {length}")
        size = BLOCK_BYTES[self.type]
        return GGUFBlocks(self.type, self.blocks.narrow(1, start // BLOCK * size, length // BLOCK * size),
                          (self.shape[0], length))

    def __getitem__(self, index) -> GGUFBlocks:
        if index is not Ellipsis:
            raise TypeError("GGUFBlocks reads whole tensors ([...]) or narrow() slices")
        return self


def weight_destination(layer: nn.Module, param: nn.Parameter, loaded) -> torch.Tensor:
    """Where a weight loader copies `loaded` to: param itself, or, for GGUF blocks, the
    layer's block buffer (made on the first shard, with param's rows and columns)."""
    if not isinstance(loaded, GGUFBlocks):
        return param.data
    rows, cols = param.shape
    current = layer.gguf
    if current is None:
        if cols % BLOCK:
            raise ModelLoadError(f"a {loaded.type} weight needs inputs in multiples of {BLOCK}, "
                                 f"this shard has {cols}")
        current = layer.gguf = GGUFBlocks(
            loaded.type, torch.zeros(rows, cols // BLOCK * BLOCK_BYTES[loaded.type], dtype=torch.uint8),
            (rows, cols))
    elif current.type != loaded.type:
        raise ModelLoadError(f"one layer's weights mix {current.type} and {loaded.type} blocks")
    return current.blocks


def source_tensor(loaded) -> torch.Tensor:
    """The tensor a loader copies: GGUF blocks' bytes, or the (float) tensor itself."""
    return loaded.blocks if isinstance(loaded, GGUFBlocks) else loaded
