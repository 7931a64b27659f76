"""Attention over the paged KV cache: the step's K/V go into their slots, then every query
row attends to its sequence's cached keys through the block table (prefill chunks and decode
tokens in one batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve import _native


@dataclass
class AttentionMetadata:
    """Plain tensors describing one step's batch; built by the model runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    # the hybrid KV layout (kv/groups.py): every KV group's slots [groups, num_tokens] and
    # tables [groups, num_seqs, max_blocks], the first group's being the two above; None
    # with one group
    group_slot_mapping: torch.Tensor | None = None
    group_block_tables: torch.Tensor | None = None
    # linear-attention layers (layers/linear_attention.py): each sequence's state row [num_seqs]
    # int64 and whether its step starts at position 0 (a fresh state, not the row's) [num_seqs]
    # bool; None in a dummy step, whose sequences start fresh in any rows
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    # prefix caching's checkpoints of those states (kv/state.py): (from row, to row) pairs
    # copied before the step (a hit resumes) and after it (a checkpoint is kept); None: none
    state_copy_in: list[tuple[int, int]] | None = None
    state_copy_out: list[tuple[int, int]] | None = None

    def for_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot_mapping, block_tables) of a layer in this KV group."""
        if group == 0:
            return self.slot_mapping, self.block_tables
        if self.group_block_tables is None:
            raise ValueError(f"a layer of KV group {group}, but the step has one group's tables")
        return self.group_slot_mapping[group], self.group_block_tables[group]

    def all_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every KV group's slot mappings [groups, T] and block tables [groups, seqs, blocks]."""
        if self.group_block_tables is None:  # one KV group
            return self.slot_mapping.unsqueeze(0), self.block_tables.unsqueeze(0)
        return self.group_slot_mapping, self.group_block_tables


class PagedAttention(nn.Module):
    """window: a sliding window (a query at position p sees keys p - window + 1 ..= p), None
    for global attention; each layer passes its own, so local and global layers mix in one
    step. softcap: scores s -> softcap * tanh(s / softcap) (Gemma 2), None for none."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.window, self.softcap = window, softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq * D]."""
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        slot_mapping, block_tables = meta.for_group(getattr(kv_cache, "group", 0))
        _native.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        out = torch.empty_like(q)
        _native.paged_attention(out, q, key_cache, value_cache, block_tables,
                                meta.query_start_loc, meta.seq_lens, self.scale, self.window or 0,
                                self.softcap or 0.0)
        return out.view(q.shape[0], -1)
