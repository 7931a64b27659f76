"""The scheduler's face of the native block pool: gives each request the blocks its tokens
need, reuses cached blocks of a shared prefix, and takes blocks back exactly once.

It knows request ids, token ids and counts, nothing of requests or their policy: the
scheduler decides who is admitted, preempted or finished and owns num_computed_tokens; this
class keeps, per request id, its block table, the content hashes of its full blocks and how
many of them are registered in the prefix cache, and reports what it allocated."""

from __future__ import annotations

from collections.abc import Sequence

from pyserve import _native
from pyserve.arith import cdiv
from pyserve.kv.prefix import extend_block_hashes


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_order: str = "lru"):
        self.pool = _native.BlockPool(num_blocks, block_order)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        self._blocks: dict[str, list[int]] = {}  # request id -> its block table
        # request id -> content hashes of its full blocks; kept across a preemption (the
        # tokens do not change), dropped with forget()
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks registered in the prefix cache
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
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: read it, do not keep it)."""
        return self._blocks.get(request_id, [])

    def _usable_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of the full blocks before the last token, which is never taken from the
        cache: its logits are needed to sample."""
        usable = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, usable * self.block_size)
        return hashes[:usable]

    def _cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        hits = []
        for h in self._usable_hashes(request_id, token_ids):
            block = self.pool.lookup(h)
            if block < 0:
                break
            hits.append(block)
        return hits

    def allocate_new(self, request_id: str, token_ids: Sequence[int], max_new_tokens: int,
                     use_cache: bool = True, count_lookup: bool = True) -> tuple[int, int] | None:
        """Admits a request holding no blocks: takes its cached prefix (unless use_cache is
        False: prompt logprobs need every position computed), then blocks for up to
        max_new_tokens more tokens. Returns (tokens found cached, tokens to compute this step),
        or None (nothing taken) if the pool is short. count_lookup: the lookup counts in the
        prefix-cache figures (a first admission, not a readmission after preemption)."""
        caching = self.enable_prefix_caching and use_cache
        hits = self._cached_prefix(request_id, token_ids) if caching else []
        cached_tokens = len(hits) * self.block_size
        n = min(len(token_ids) - cached_tokens, max_new_tokens)
        new_blocks = self.blocks_for(cached_tokens + n) - len(hits)
        # hits sitting in the free queue stop being free once acquired
        reclaimed = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if new_blocks + reclaimed > self.pool.num_free:
            return None
        self.pool.acquire(hits)
        self._blocks[request_id] = hits + self.pool.allocate(new_blocks)
        self._num_cached[request_id] = len(hits)
        pending = self._hashes.get(request_id, [])[len(hits):] if caching else []
        if pending:
            self._pending[request_id] = list(pending)
            for h in pending:
                self._computing[h] = self._computing.get(h, 0) + 1
        if count_lookup:
            self.prefix_queries += len(token_ids)
            self.prefix_hits += cached_tokens
        return cached_tokens, n

    def prefix_in_flight(self, request_id: str, token_ids: Sequence[int], use_cache: bool = True) -> bool:
        """The block after the waiting request's cached prefix is being computed by a running
        request: admitted one step later, it would find that block (and what follows it)
        cached instead of computing it a second time. Checked on hashes alone, without pool
        lookups: a hash names its whole prefix, so a computing block's predecessors are all
        cached or computing too, and any match is the first uncached block or follows it."""
        if not self.enable_prefix_caching or not self._computing or not use_cache:
            return False
        return any(h in self._computing for h in self._usable_hashes(request_id, token_ids))

    def _done_computing(self, request_id: str, num_blocks: int | None = None) -> None:
        """The request no longer computes its first num_blocks pending blocks (all if None)."""
        pending = self._pending.get(request_id)
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
            del self._pending[request_id]

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's block table to hold num_tokens tokens; False (nothing taken) if
        the pool is short."""
        blocks = self._blocks.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        blocks.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """After a step: registers the request's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        cached = self._num_cached.get(request_id, 0)
        if full <= cached:
            return
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, full * self.block_size)
        blocks = self._blocks[request_id]
        for i in range(cached, full):
            self.pool.cache(blocks[i], hashes[i])
        self._done_computing(request_id, full - cached)
        self._num_cached[request_id] = full

    def free(self, request_id: str) -> None:
        """Returns the request's blocks, last first, so that a sequence's tail is evicted
        before its (more shareable) head. Its hashes stay (see forget)."""
        blocks = self._blocks.pop(request_id, None)
        if blocks:
            self.pool.free(blocks[::-1])
        self._done_computing(request_id)
        self._num_cached.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request has ended: its blocks go back, and nothing of it stays."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    def num_tracked_requests(self) -> int:
        """Requests the manager holds state for (0 once every request has ended)."""
        return len(self._blocks.keys() | self._hashes.keys() | self._pending.keys())

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
