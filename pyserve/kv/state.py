"""The state pool's bookkeeping, for models with linear-attention layers (models/qwen3_next.py):
which row of the pool each running request computes in, and which rows hold checkpoints of a
state at a block boundary of a cached prefix.

A linear layer's state has no per-token entries to page or share: a prefix hit must resume
from the state at the hit's end. So, as vLLM does for mamba-like layers, states are kept at
block-aligned points: a step that ends on a checkpoint boundary (a multiple of `interval`
tokens, and a prompt's last full block before its last token) has its request's state copied
into a checkpoint row afterwards, registered under the hash of the block that ends there
(which names the whole prefix, kv/prefix.py). A later request whose cached blocks reach such a
boundary copies that row into its own before its first step and resumes there; the hit is the
longest cached prefix that ends on a checkpoint. Checkpoints are evicted least recently used,
by a native pool of their own. Rows: slots 0 .. num_slots - 1, then the checkpoints."""

from __future__ import annotations

from collections.abc import Sequence

from pyserve import _native


class StatePool:
    def __init__(self, num_slots: int, num_checkpoints: int, block_size: int, interval: int):
        self.num_slots, self.num_checkpoints = num_slots, num_checkpoints
        self.block_size = block_size
        self.interval = max(block_size, interval // block_size * block_size)
        self._slots = _native.BlockPool(num_slots, "lru")
        self._checkpoints = _native.BlockPool(num_checkpoints, "lru") if num_checkpoints else None
        self._slot: dict[str, int] = {}  # request id -> its row
        self._resume: dict[str, int] = {}  # request id -> checkpoint it starts from (held)
        self._pending: dict[str, tuple[int, bytes]] = {}  # request id -> (checkpoint, hash) its step writes
        self.checkpoint_hits = 0  # requests that resumed from a checkpoint

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def num_checkpoints_kept(self) -> int:
        """Checkpoints registered under a prefix's hash (held or evictable)."""
        return self._checkpoints.num_cached if self._checkpoints is not None else 0

    @property
    def num_checkpoints_held(self) -> int:
        """Checkpoints a request holds (one it resumes from, or its step writes)."""
        if self._checkpoints is None:
            return 0
        return sum(1 for c in range(self.num_checkpoints) if self._checkpoints.ref_count(c) > 0)

    def has_slot(self, request_id: str) -> bool:
        return request_id in self._slot

    def take_slot(self, request_id: str) -> bool:
        """The request's row (taken once); False if none is free."""
        if request_id in self._slot:
            return True
        if self._slots.num_free == 0:
            return False
        (self._slot[request_id],) = self._slots.allocate(1)
        return True

    def slot(self, request_id: str) -> int:
        return self._slot[request_id]

    def checkpointed(self, hashes: Sequence[bytes], num_blocks: int) -> tuple[int, int]:
        """(k, checkpoint): the longest prefix of at most num_blocks cached blocks whose end has
        a checkpoint, and that checkpoint (-1 and 0 blocks where none)."""
        if self._checkpoints is None:
            return 0, -1
        for k in range(num_blocks, 0, -1):
            found = self._checkpoints.lookup(hashes[k - 1])
            if found >= 0:
                return k, found
        return 0, -1

    def resume_from(self, request_id: str, checkpoint: int) -> None:
        """The request starts from this checkpoint: held until its first step has read it."""
        self._checkpoints.acquire([checkpoint])
        self._resume[request_id] = checkpoint
        self.checkpoint_hits += 1

    def source_row(self, request_id: str) -> int:
        """The checkpoint row the request's next step copies its state from, or -1."""
        checkpoint = self._resume.get(request_id)
        return -1 if checkpoint is None else self.num_slots + checkpoint

    def cut(self, start: int, n: int, num_tokens: int) -> int:
        """n tokens from start, cut so that the step ends on the first checkpoint boundary
        inside it: a multiple of interval, or the last full block before the last of the
        request's num_tokens."""
        if self._checkpoints is None:
            return n
        end = start + n
        boundary = (start // self.interval + 1) * self.interval
        last = (num_tokens - 1) // self.block_size * self.block_size
        if start < last < boundary:
            boundary = last
        return boundary - start if boundary < end else n

    def target_row(self, request_id: str, end: int, hashes: Sequence[bytes]) -> int:
        """The checkpoint row a step ending at `end` copies the request's state into
        afterwards, or -1: at a checkpoint boundary within the hashed blocks, where no
        checkpoint of that prefix is kept yet (the least recently used one is evicted)."""
        if self._checkpoints is None or end == 0 or end % self.block_size or end // self.block_size > len(hashes):
            return -1
        if end % self.interval and end != len(hashes) * self.block_size:
            return -1
        block_hash = hashes[end // self.block_size - 1]
        if self._checkpoints.lookup(block_hash) >= 0 or self._checkpoints.num_free == 0:
            return -1
        self._release_pending(request_id)
        (checkpoint,) = self._checkpoints.allocate(1)
        self._pending[request_id] = (checkpoint, block_hash)
        return self.num_slots + checkpoint

    def ran(self, request_id: str) -> None:
        """The request's step ran: the checkpoint it read is released, the one it wrote is
        registered (and evictable from now on)."""
        checkpoint = self._resume.pop(request_id, None)
        if checkpoint is not None:
            self._checkpoints.free([checkpoint])
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            checkpoint, block_hash = pending
            if self._checkpoints.lookup(block_hash) < 0:
                self._checkpoints.cache(checkpoint, block_hash)
            self._checkpoints.free([checkpoint])

    def _release_pending(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._checkpoints.free([pending[0]])

    def free(self, request_id: str) -> None:
        """The request's row and what it holds go back (its step, if any, never counted)."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._slots.free([slot])
        checkpoint = self._resume.pop(request_id, None)
        if checkpoint is not None:
            self._checkpoints.free([checkpoint])
        self._release_pending(request_id)

    def tracked(self) -> set[str]:
        return self._slot.keys() | self._resume.keys() | self._pending.keys()
