"""Where this process sits in its tensor-parallel group. Layers take it explicitly."""

from dataclasses import dataclass


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def shard(self, total: int, what: str) -> int:
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size


SINGLE = TPGroup()
