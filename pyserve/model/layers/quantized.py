"""GGUF-quantized weights kept quantized: a checkpoint tensor's raw blocks travel through the
layers' ordinary weight loaders (column, row and vocabulary shards alike) into a block buffer
beside the layer's float parameter, which then stays empty; pack_for_cpu packs the buffer for
the CPU kernel. A block holds 32 consecutive inputs of one output row (256 for the K-quants'
super-blocks), so output rows split anywhere and inputs split on whole blocks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve.errors import ModelLoadError

# GGUF types the CPU kernel reads directly -> bytes per block, and weights per block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def _input_bytes(type_: str, blocks: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """The bytes of inputs start .. start + length of every row (the last dimension), which
    must fall on whole blocks."""
    block = BLOCK_WEIGHTS[type_]
    if start % block or length % block:
        raise ModelLoadError(f"a {type_} tensor splits its inputs only on multiples of "
                             f"{block}, not at {start} + {length}")
    size = BLOCK_BYTES[type_]
    return blocks.narrow(-1, start // block * size, length // block * size)


@dataclass
class GGUFBlocks:
    """A checkpoint tensor [rows, cols] as raw GGUF blocks [rows, cols / 32 * block bytes]."""

    type: str
    blocks: torch.Tensor  # uint8
    shape: tuple[int, int]

    def narrow(self, dim: int, start: int, length: int) -> GGUFBlocks:
        if dim == 0:
            return GGUFBlocks(self.type, self.blocks.narrow(0, start, length), (length, self.shape[1]))
        return GGUFBlocks(self.type, _input_bytes(self.type, self.blocks, start, length),
                          (self.shape[0], length))

    def __getitem__(self, index) -> GGUFBlocks:
        if index is not Ellipsis:
            raise TypeError("GGUFBlocks reads whole tensors ([...]) or narrow() slices")
        return self


@dataclass
class GGUFExperts:
    """A GGUF file's stacked expert tensor (llama.cpp's ffn_gate_exps, ffn_up_exps,
    ffn_down_exps) as raw blocks [E, rows, cols / block weights * block bytes]."""

    type: str
    blocks: torch.Tensor  # uint8
    shape: tuple[int, int, int]  # (E, rows, cols)

    def narrow(self, dim: int, start: int, length: int) -> GGUFExperts:
        """Each expert's rows (dim 1) or inputs (dim 2: on whole blocks) of a rank's share."""
        if dim == 1:
            return GGUFExperts(self.type, self.blocks.narrow(1, start, length),
                               (self.shape[0], length, self.shape[2]))
        if dim != 2:
            raise ValueError("GGUFExperts narrows rows (1) or inputs (2)")
        return GGUFExperts(self.type, _input_bytes(self.type, self.blocks, start, length),
                           (self.shape[0], self.shape[1], length))


@dataclass
class GGUFParts:
    """The GGUF blocks of a merged parameter (q/k/v, gate/up), one buffer per logical part in
    output order: llama.cpp's mixes (Q4_K_M) often keep v in another type than q and k, and
    each part keeps its own. Parts of one type are joined into one buffer when packed."""

    parts: list[GGUFBlocks | None]

    @property
    def types(self) -> set[str]:
        return {p.type for p in self.parts if p is not None}

    def joined(self) -> GGUFBlocks:
        """One buffer for parts that share a type (as one tensor of that type would load)."""
        (type_,) = self.types
        blocks = torch.cat([p.blocks for p in self.parts])
        return GGUFBlocks(type_, blocks, (blocks.shape[0], self.parts[0].shape[1]))


def part_destination(layer: nn.Module, loaded: GGUFBlocks, part: int, num_parts: int,
                     rows: int, cols: int) -> torch.Tensor:
    """The block buffer of one part (of num_parts; this rank's rows x cols) of a merged
    parameter loaded from GGUF blocks."""
    if layer.gguf is None:
        layer.gguf = GGUFParts([None] * num_parts)
    block = BLOCK_WEIGHTS[loaded.type]
    if cols % block:
        raise ModelLoadError(f"a {loaded.type} weight needs inputs in multiples of {block}, "
                             f"this shard has {cols}")
    buffer = torch.zeros(rows, cols // block * BLOCK_BYTES[loaded.type], dtype=torch.uint8)
    layer.gguf.parts[part] = GGUFBlocks(loaded.type, buffer, (rows, cols))
    return buffer


def weight_destination(layer: nn.Module, param: nn.Parameter, loaded) -> torch.Tensor:
    """Where a weight loader copies `loaded` to: param itself, or, for GGUF blocks, the
    layer's block buffer (made on the first shard, with param's rows and columns)."""
    if not isinstance(loaded, GGUFBlocks):
        return param.data
    rows, cols = param.shape
    current = layer.gguf
    if current is None:
        block = BLOCK_WEIGHTS[loaded.type]
        if cols % block:
            raise ModelLoadError(f"a {loaded.type} weight needs inputs in multiples of {block}, "
                                 f"this shard has {cols}")
        current = layer.gguf = GGUFBlocks(
            loaded.type, torch.zeros(rows, cols // block * BLOCK_BYTES[loaded.type], dtype=torch.uint8),
            (rows, cols))
    elif current.type != loaded.type:
        raise ModelLoadError(f"one layer's weights mix {current.type} and {loaded.type} blocks")
    return current.blocks


def source_tensor(loaded) -> torch.Tensor:
    """The tensor a loader copies: GGUF blocks' bytes, or the (float) tensor itself."""
    return loaded.blocks if isinstance(loaded, GGUFBlocks) else loaded
