"""The engine's face of the native block pool: gives each request the blocks its tokens need
and takes them back exactly once."""

from __future__ import annotations

from pyserve import _native
from pyserve.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.pool = _native.BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_tokens: int) -> bool:
        """Grows request's block table to hold num_tokens tokens; False (nothing taken) if the
        pool is short."""
        need = self.blocks_for(num_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last first, so that the tail of a sequence is the
        first to be reused."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            request.block_ids = []
