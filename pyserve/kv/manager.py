"""The engine's face of the native block pool: gives each request the blocks its tokens need,
reuses cached blocks of a shared prefix, and takes blocks back exactly once."""

from __future__ import annotations

from pyserve import _native
from pyserve.engine.request import Request
from pyserve.kv.prefix import extend_block_hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_order: str = "lru"):
        self.pool = _native.BlockPool(num_blocks, block_order)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        # hash -> how many running requests are computing that full prompt block right now,
        # and, per request id, the hashes it counts for (in block order)
        self._computing: dict[bytes, int] = {}
        self._pending: dict[str, list[bytes]] = {}

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
        pending = request.block_hashes[len(hits):] if self.enable_prefix_caching else []
        if pending:
            self._pending[request.request_id] = list(pending)
            for h in pending:
                self._computing[h] = self._computing.get(h, 0) + 1
        if request.num_preemptions == 0:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += cached_tokens
        return n

    def prefix_in_flight(self, request: Request) -> bool:
        """The block after the waiting request's cached prefix is being computed by a running
        request: admitted one step later, it would find that block (and what follows it)
        cached instead of computing it a second time. Checked on hashes alone, without pool
        lookups: a hash names its whole prefix, so a computing block's predecessors are all
        cached or computing too, and any match is the first uncached block or follows it."""
        if (not self.enable_prefix_caching or not self._computing
                or request.params.prompt_logprobs is not None):
            return False
        usable = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids(), self.block_size,
                            usable * self.block_size)
        return any(h in self._computing for h in request.block_hashes[:usable])

    def _done_computing(self, request: Request, num_blocks: int | None = None) -> None:
        """The request no longer computes its first num_blocks pending blocks (all if None)."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return
        done = pending if num_blocks is None else pending[:num_blocks]
        for h in done:
            left = self._computing[h] - 1
            if left:
                self._computing[h] = left
            else:
                del self._computing[h]
        del pending[:len(done)]
        if not pending:
            del self._pending[request.request_id]

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
        self._done_computing(request, full - request.num_cached_blocks)
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Returns the request's blocks, last first, so that a sequence's tail is evicted
        before its (more shareable) head."""
        if request.block_ids:
            self.pool.free(request.block_ids[::-1])
            self._done_computing(request)
            request.block_ids = []
        request.num_cached_blocks = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
