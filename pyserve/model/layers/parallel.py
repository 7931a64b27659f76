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
