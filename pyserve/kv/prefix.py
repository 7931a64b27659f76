"""Content hashes of full KV blocks, for prefix caching.

hash(block i) = SHA-256(hash(block i-1) || token ids of block i), starting from a fixed root,
so a hash names the whole prefix up to the end of its block, not just the block's own tokens.
SHA-256 makes an accidental collision (two different prefixes, one hash) no practical risk,
so a hit is trusted without re-reading tokens. Nothing else changes a block's content today
(one model, no adapters or images per request); such inputs would join the hashed bytes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT = hashlib.sha256(b"pyserve-prefix-cache-v1").digest()


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_tokens: int) -> None:
    """Appends the hashes of the full blocks within token_ids[:num_tokens] not yet hashed."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else ROOT
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size]))
