"""The scheduler's face of the native block pool: gives each request the blocks its tokens
need, reuses cached blocks of a shared prefix, and takes blocks back exactly once.

It knows request ids, token ids and counts, nothing of requests or their policy: the
scheduler decides who is admitted, preempted or finished and owns num_computed_tokens; this
class keeps, per request id, its block table, the content hashes of its full blocks and how
many of them are registered in the prefix cache, and reports what it allocated.

Under the hybrid layout (kv/groups.py) a request has one table per KV group, all as long as
its token count needs. A sliding group's blocks that fell out of the window go back to the
pool (allocate_slots, given the step's first position) and their entries become null_block.
They keep their cache entries while free, under a hash qualified by the group, so a prefix is
still found: a hit of k blocks needs all k in every global group and, in every sliding group,
the blocks that the first computed position's window reaches (the earlier ones may be gone);
the hit is the longest k for which every group has what it needs.

A model with linear-attention layers also needs one row of its state pool per running
request (kv/state.py): taken with the request's first blocks, given back with them (finish,
abort, preemption), so admission waits for a row as for blocks. Its prefix hits end where a
checkpoint of the linear state is kept (kv/state.py), and its steps are cut to end on the
checkpoint boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from pyserve import _native
from pyserve.arith import cdiv
from pyserve.kv.groups import KVGroups, single_group
from pyserve.kv.prefix import extend_block_hashes
from pyserve.kv.state import StatePool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_order: str = "lru", groups: KVGroups | None = None, state: StatePool | None = None):
        self.pool = _native.BlockPool(num_blocks, block_order)
        self.state = state  # linear-attention layers' state rows, or None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups or single_group(0)
        self.num_groups = self.groups.num_groups
        self._sliding = [g for g, w in enumerate(self.groups.windows) if w is not None]
        self.null_block = num_blocks  # what a freed sliding entry names (kv/groups.py)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found cached
        self._blocks: dict[str, list[list[int]]] = {}  # request id -> its table per group
        # request id -> per sliding group, the entries before this one are null_block
        self._window_start: dict[str, list[int]] = {}
        # request id -> the prompt's cacheable blocks at admission: a sliding group keeps the
        # window before their end until the request ends, so that the same prompt again finds
        # its prefix (freed early, those blocks would be the first a CPU pool hands out again)
        self._prompt_blocks: dict[str, int] = {}
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

    def state_rows(self, request_id: str, start: int, n: int, token_ids: Sequence[int]) -> tuple[int, int, int]:
        """A step's (row, checkpoint row it starts from or -1, checkpoint row it writes or
        -1) in the state pool, for a request computing n tokens from start."""
        state = self.state
        target = -1
        if self.enable_prefix_caching:
            target = state.target_row(request_id, start + n, self._usable_hashes(request_id, token_ids))
        return state.slot(request_id), state.source_row(request_id), target

    def cut_step(self, start: int, n: int, num_tokens: int) -> int:
        """n tokens from start, cut at the state pool's next checkpoint boundary (kv/state.py)."""
        if self.state is None or not self.enable_prefix_caching:
            return n
        return self.state.cut(start, n, num_tokens)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table, its first group's (the manager's own list: read it, do
        not keep it)."""
        tables = self._blocks.get(request_id)
        return tables[0] if tables else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's tables of the groups after the first ([] with one group)."""
        tables = self._blocks.get(request_id)
        return tables[1:] if tables else []

    def _group_hash(self, h: bytes, group: int) -> bytes:
        return h if group == 0 else h + bytes((group,))

    def _usable_hashes(self, request_id: str, token_ids: Sequence[int]) -> list[bytes]:
        """Hashes of the full blocks before the last token, which is never taken from the
        cache: its logits are needed to sample."""
        usable = (len(token_ids) - 1) // self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, usable * self.block_size)
        return hashes[:usable]

    def _cached_prefix(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[list[int]], int]:
        """Per group, the cached blocks a hit of k blocks takes (null_block where a sliding
        group needs none), for the largest k every group can serve (and, with a state pool,
        that ends on a checkpoint of the linear state); and that checkpoint, or -1."""
        hashes = self._usable_hashes(request_id, token_ids)
        windows = self.groups.windows
        chains = {}
        k = len(hashes)
        for g, window in enumerate(windows):  # a global group: a chain from the first block
            if window is None:
                chain = chains[g] = []
                for h in hashes[:k]:
                    block = self.pool.lookup(self._group_hash(h, g))
                    if block < 0:
                        break
                    chain.append(block)
                k = len(chain)
        found: dict[tuple[int, int], int] = {}

        def lookup(g: int, i: int) -> int:
            if (g, i) not in found:
                found[g, i] = self.pool.lookup(self._group_hash(hashes[i], g))
            return found[g, i]

        bs = self.block_size
        while k > 0 and not all(lookup(g, i) >= 0 for g in self._sliding
                                for i in range(self.groups.window_start(g, k * bs, bs), k)):
            k -= 1
        checkpoint = -1
        if self.state is not None:  # the hit ends where a linear state was kept
            k, checkpoint = self.state.checkpointed(hashes, k)
        tables = []
        for g, window in enumerate(windows):
            if window is None:
                tables.append(chains[g][:k])
            else:
                lo = self.groups.window_start(g, k * bs, bs)
                tables.append([self.null_block] * lo + [lookup(g, i) for i in range(lo, k)])
        return tables, checkpoint

    def allocate_new(self, request_id: str, token_ids: Sequence[int], max_new_tokens: int,
                     use_cache: bool = True, count_lookup: bool = True) -> tuple[int, int] | None:
        """Admits a request holding no blocks: takes its cached prefix (unless use_cache is
        False: prompt logprobs need every position computed), then blocks for up to
        max_new_tokens more tokens. Returns (tokens found cached, tokens to compute this step),
        or None (nothing taken) if the pool is short. count_lookup: the lookup counts in the
        prefix-cache figures (a first admission, not a readmission after preemption)."""
        caching = self.enable_prefix_caching and use_cache
        tables, checkpoint = (self._cached_prefix(request_id, token_ids) if caching
                              else ([[] for _ in range(self.num_groups)], -1))
        num_hits = len(tables[0])
        cached_tokens = num_hits * self.block_size
        n = self.cut_step(cached_tokens, min(len(token_ids) - cached_tokens, max_new_tokens), len(token_ids))
        new_blocks = self.blocks_for(cached_tokens + n) - num_hits  # per group
        hits = [b for table in tables for b in table if b != self.null_block]
        # hits sitting in the free queue stop being free once acquired
        reclaimed = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if new_blocks * self.num_groups + reclaimed > self.pool.num_free:
            return None
        if self.state is not None:
            if not self.state.take_slot(request_id):
                return None
            if num_hits:
                self.state.resume_from(request_id, checkpoint)
        self.pool.acquire(hits)
        for table in tables:
            table.extend(self.pool.allocate(new_blocks))
        self._blocks[request_id] = tables
        if self._sliding:
            self._window_start[request_id] = [
                self.groups.window_start(g, cached_tokens, self.block_size) for g in self._sliding]
            if caching:
                self._prompt_blocks[request_id] = (len(token_ids) - 1) // self.block_size
        self._num_cached[request_id] = num_hits
        pending = self._hashes.get(request_id, [])[num_hits:] if caching else []
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

    def allocate_slots(self, request_id: str, num_tokens: int, first_position: int = 0) -> bool:
        """Grows the request's block tables to hold num_tokens tokens; False (nothing taken) if
        the pool is short. first_position: the step's first computed position; the sliding
        groups' blocks before its window go back to the pool first."""
        tables = self._blocks.get(request_id)
        if tables is None:
            if self.state is not None and not self.state.take_slot(request_id):
                return False
            tables = self._blocks[request_id] = [[] for _ in range(self.num_groups)]
            if self._sliding:
                self._window_start[request_id] = [0] * len(self._sliding)
        if self._sliding and first_position:
            self._free_out_of_window(request_id, first_position)
        need = self.blocks_for(num_tokens) - len(tables[0])
        if need <= 0:
            return True
        if need * self.num_groups > self.pool.num_free:
            return False
        for table in tables:
            table.extend(self.pool.allocate(need))
        return True

    def _free_out_of_window(self, request_id: str, first_position: int) -> None:
        tables, starts = self._blocks[request_id], self._window_start[request_id]
        prompt_blocks = self._prompt_blocks.get(request_id, 0)
        freed = []
        for k, g in enumerate(self._sliding):
            table = tables[g]
            start = min(self.groups.window_start(g, first_position, self.block_size), len(table))
            keep = range(self.groups.window_start(g, prompt_blocks * self.block_size, self.block_size),
                          prompt_blocks)
            for i in range(starts[k], start):
                if table[i] != self.null_block and i not in keep:
                    freed.append(table[i])
                    table[i] = self.null_block
            starts[k] = max(starts[k], start)
        if freed:
            self.pool.free(freed)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """After a step: registers the request's blocks that became full of computed tokens
        (and the linear state's checkpoint the step wrote, kv/state.py)."""
        if self.state is not None:
            self.state.ran(request_id)
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        cached = self._num_cached.get(request_id, 0)
        if full <= cached:
            return
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, token_ids, self.block_size, full * self.block_size)
        for g, blocks in enumerate(self._blocks[request_id]):
            for i in range(cached, full):
                if blocks[i] != self.null_block:
                    self.pool.cache(blocks[i], self._group_hash(hashes[i], g))
        self._done_computing(request_id, full - cached)
        self._num_cached[request_id] = full

    def free(self, request_id: str) -> None:
        """Returns the request's blocks, last first, so that a sequence's tail is evicted
        before its (more shareable) head. Its hashes stay (see forget)."""
        tables = self._blocks.pop(request_id, None)
        self._window_start.pop(request_id, None)
        self._prompt_blocks.pop(request_id, None)
        for blocks in tables or ():
            self.pool.free([b for b in reversed(blocks) if b != self.null_block])
        if self.state is not None:
            self.state.free(request_id)
        self._done_computing(request_id)
        self._num_cached.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """The request has ended: its blocks go back, and nothing of it stays."""
        self.free(request_id)
        self._hashes.pop(request_id, None)

    def num_tracked_requests(self) -> int:
        """Requests the manager holds state for (0 once every request has ended)."""
        return len(self._blocks.keys() | self._hashes.keys() | self._pending.keys()
                   | self._window_start.keys() | self._prompt_blocks.keys()
                   | (self.state.tracked() if self.state is not None else set()))

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
