"""A step's batch cut into micro-batches for pipeline parallelism, so that stages overlap:
while stage 1 runs the first micro-batch, stage 0 runs the second.

A micro-batch is a run of whole sequences (a sequence's tokens attend to each other and to its
own KV cache only, so sequences can run in any grouping), cut where the token count is closest
to an even share. Every rank cuts the same way from the same step inputs, so the stages'
sends and receives pair up; the last stage puts the micro-batches' hidden states back in step
order, where the step's logits rows index them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyserve.model.layers.attention import AttentionMetadata


@dataclass
class MicroBatch:
    tokens: slice  # of the step's tokens
    meta: AttentionMetadata  # its sequences only, query_start_loc from 0


def split_micro_batches(meta: AttentionMetadata, count: int) -> list[MicroBatch]:
    """At most count micro-batches of at least one sequence each, in step order."""
    starts = meta.query_start_loc.tolist()
    num_seqs = len(starts) - 1
    count = max(1, min(count, num_seqs))
    total = starts[-1]
    cuts = [0]
    for k in range(1, count):  # the sequence boundary nearest k / count of the tokens
        goal = total * k / count
        best = min(range(cuts[-1] + 1, num_seqs - (count - k) + 1),
                   key=lambda s: abs(starts[s] - goal))
        cuts.append(best)
    cuts.append(num_seqs)
    return [_micro_batch(meta, starts, a, b) for a, b in zip(cuts, cuts[1:])]


def _micro_batch(meta: AttentionMetadata, starts: list[int], first: int, end: int) -> MicroBatch:
    t0, t1 = starts[first], starts[end]
    sub = AttentionMetadata(meta.slot_mapping[t0:t1], meta.block_tables[first:end],
                            meta.query_start_loc[first:end + 1] - t0, meta.seq_lens[first:end])
    if meta.group_block_tables is not None:
        sub.group_slot_mapping = meta.group_slot_mapping[:, t0:t1]
        sub.group_block_tables = meta.group_block_tables[:, first:end]
    return MicroBatch(slice(t0, t1), sub)


def join_hidden(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
