"""Where this process sits in its tensor-parallel group, and the communicator its layers
reduce through. Layers take it explicitly; at size 1 there is no communicator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # a pyserve._C communicator (ShmCommunicator on CPU, NcclCommunicator on CUDA)
    comm: object | None = field(default=None, compare=False, repr=False)

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place where x is contiguous."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.comm.all_reduce(x)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: [size, *x.shape], every rank's x in rank order; other ranks: None."""
        if self.size == 1:
            return x.unsqueeze(0)
        gathered = self.comm.gather(x.contiguous(), 0)
        return gathered if self.rank == 0 else None


SINGLE = TPGroup()


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks; with fewer KV heads than ranks each rank keeps (a replica
    of) the one its query heads use."""
    return max(1, num_kv_heads // tp_size)


@dataclass(frozen=True)
class PipelineStage:
    """Which contiguous layers [start_layer, end_layer) this process's pipeline stage runs, of
    size stages. The first stage embeds the tokens; the last applies the final norm and the LM
    head (and holds the embedding for it where the model ties them)."""

    index: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int | None = None  # None: through the last layer (one stage)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def owns_layer(self, layer: int) -> bool:
        return self.start_layer <= layer and (self.end_layer is None or layer < self.end_layer)


WHOLE_MODEL = PipelineStage()


def stage_layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Layers per pipeline stage, as even as possible, by vLLM's rule: the remainder goes one
    layer each to the stages before the last, from the second-to-last backwards (the first
    stage holds the embedding and the last the LM head, so those take extra layers last; the
    last never gets one). 5 layers on 2 stages: [3, 2]; 10 on 4: [2, 3, 3, 2]."""
    counts = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        counts[-2 - i] += 1
    return counts


def pipeline_stage(num_layers: int, num_stages: int, index: int) -> PipelineStage:
    if num_stages == 1:
        return WHOLE_MODEL
    counts = stage_layer_counts(num_layers, num_stages)
    start = sum(counts[:index])
    return PipelineStage(index, num_stages, start, start + counts[index])
