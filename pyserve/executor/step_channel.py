"""Rank 0 -> the other ranks: each step's ForwardInputs as one message in a fixed binary
layout, through the shared-memory communicator (no pickle, no sockets).

The message (pyserve._C ShmCommunicator.broadcast_tensors) carries seven arrays in this
order, each as raw bytes: int64 input_ids[T], positions[T], slot_mapping[T], logits_rows[R],
int32 block_tables[S x B], query_start_loc[S + 1], seq_lens[S]; S comes from seq_lens and B
from the block tables' size. Under the hybrid KV layout (kv/groups.py) slot_mapping and
block_tables carry every group's, [G x T] and [G x S x B], G read off slot_mapping's size
against input_ids'. Rank 0 sends a step just before it runs it; the ranks' first
collective in the forward pass keeps the next message from overtaking this one."""

from __future__ import annotations

import torch

from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.runner import ForwardInputs


class StepChannel:
    def __init__(self, comm):
        self.comm = comm

    def send(self, inputs: ForwardInputs) -> None:
        m = inputs.meta
        grouped = m.group_block_tables is not None
        self.comm.broadcast_tensors([inputs.input_ids, inputs.positions,
                                     m.group_slot_mapping if grouped else m.slot_mapping,
                                     inputs.logits_rows,
                                     m.group_block_tables if grouped else m.block_tables,
                                     m.query_start_loc, m.seq_lens], 0)

    def receive(self) -> ForwardInputs:
        """Waits (without holding the GIL) for rank 0's next step."""
        raw = self.comm.broadcast_tensors([], 0)
        input_ids, positions, slot_mapping, logits_rows = (x.view(torch.int64) for x in raw[:4])
        tables, query_start_loc, seq_lens = (x.view(torch.int32) for x in raw[4:])
        num_seqs = seq_lens.numel()
        num_groups = slot_mapping.numel() // input_ids.numel() if input_ids.numel() else 1
        if num_groups > 1:
            slots = slot_mapping.view(num_groups, -1)
            tables = tables.view(num_groups, num_seqs, -1)
            meta = AttentionMetadata(slots[0], tables[0], query_start_loc, seq_lens, slots, tables)
        else:
            meta = AttentionMetadata(slot_mapping, tables.view(num_seqs, -1 if num_seqs else 0),
                                     query_start_loc, seq_lens)
        return ForwardInputs(input_ids, positions, meta, logits_rows)
