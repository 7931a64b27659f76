"""The engine's face of the native block pool: gives each request the blocks its tokens need,
reuses cached blocks of a shared prefix, and takes blocks back exactly once."""

from __future__ import annotations

from pyserve import _native
from pyserve.engine.request import Request
from pyserve.kv.prefix import extend_block_hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool = _native.BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the request's leading full blocks. The last token is never
        taken from the cache: its logits are needed to sample."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        usable = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids(), self.block_size,
                            usable * self.block_size)
        hits = []
        for h in request.block_hashes[:usable]:
            block = self.pool.lookup(h)
            if block < 0:
                break
            hits.append(block)
        return hits

    def allocate_new_request(self, request: Request, max_new_tokens: int) -> int | None:
        """Admits a request with no blocks: takes its cached prefix, then blocks for up to
        max_new_tokens more tokens. Returns how many tokens to compute this step, or None
        (nothing taken) if the pool is short."""
        hits = self._cached_prefix(request)
        cached_tokens = len(hits) * self.block_size
        n = min(request.num_tokens - cached_tokens, max_new_tokens)
        new_blocks = self.blocks_for(cached_tokens + n) - len(hits)
        # hits sitting in the free queue stop being free once acquired
        reclaimed = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if new_blocks + reclaimed > self.pool.num_free:
            return None
        self.pool.acquire(hits)
        request.block_ids = hits + self.pool.allocate(new_blocks)
        request.num_computed_tokens = cached_tokens
        request.num_cached_blocks = len(hits)
        if request.num_preemptions == 0:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += cached_tokens
        return n

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

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: registers the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_cached_blocks:
            return
        extend_block_hashes(request.block_hashes, request.token_ids(), self.block_size,
                            full * self.block_size)
        for i in range(request.num_cached_blocks, full):
            self.pool.cache(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last first, so that a sequence's tail is evicted
        before its (more shareable) head."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            request.block_ids = []
        request.num_cached_blocks = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
