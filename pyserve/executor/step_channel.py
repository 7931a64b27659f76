"""Rank 0 -> the other ranks: each step's ForwardInputs, in a fixed binary layout, through
the shared-memory communicator's broadcast (no pickle, no sockets).

Layout: a header of 8 int64 [T tokens, S sequences, B block-table columns, R logits rows,
0, 0, 0, 0], then one byte payload:
    int64 input_ids[T], positions[T], slot_mapping[T], logits_rows[R],
    int32 block_tables[S x B], query_start_loc[S + 1], seq_lens[S].
Rank 0 sends one step before it runs it; the ranks' first collective in the forward pass
orders the next send after every rank has read this one."""

from __future__ import annotations

import torch

from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.runner import ForwardInputs

HEADER_LEN = 8


def payload_bytes(t: int, s: int, b: int, r: int) -> int:
    return 8 * (3 * t + r) + 4 * (s * b + 2 * s + 1)


class StepChannel:
    def __init__(self, comm):
        self.comm = comm

    def send(self, inputs: ForwardInputs) -> None:
        m = inputs.meta
        s, b = m.block_tables.shape
        header = torch.tensor([inputs.input_ids.numel(), s, b, inputs.logits_rows.numel(), 0, 0, 0, 0],
                              dtype=torch.int64)
        parts = [inputs.input_ids, inputs.positions, m.slot_mapping, inputs.logits_rows,
                 m.block_tables, m.query_start_loc, m.seq_lens]
        payload = torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])
        self.comm.broadcast(header, 0)
        self.comm.broadcast(payload, 0)

    def receive(self) -> ForwardInputs:
        """Waits (without holding the GIL) for rank 0's next step."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self.comm.broadcast(header, 0)
        t, s, b, r = header[:4].tolist()
        payload = torch.empty(payload_bytes(t, s, b, r), dtype=torch.uint8)
        self.comm.broadcast(payload, 0)
        sizes = [8 * t, 8 * t, 8 * t, 8 * r, 4 * s * b, 4 * (s + 1), 4 * s]
        raw = payload.split(sizes)
        longs = [x.view(torch.int64) for x in raw[:4]]
        ints = [x.view(torch.int32) for x in raw[4:]]
        meta = AttentionMetadata(slot_mapping=longs[2], block_tables=ints[0].view(s, b),
                                 query_start_loc=ints[1], seq_lens=ints[2])
        return ForwardInputs(longs[0], longs[1], meta, longs[3])
