"""One step on the device: scheduled requests -> input tensors (prepare, on the event loop,
where request state lives) -> forward and sampling (run, safe to call from the model thread:
it touches only the prepared tensors, the model and the sampling requests' generators)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyserve.engine.scheduler import ScheduledRequest
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.sampler import sample


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states whose logits are sampled
    sampling: list  # the requests sampled, in row order


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, device: torch.device,
                 seed: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def prepare(self, batch: list[ScheduledRequest]) -> PreparedBatch:
        bs = self.block_size
        input_ids, positions, slots, starts, seq_lens, sample_rows = [], [], [], [0], [], []
        max_blocks = max(len(s.request.block_ids) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for row, s in enumerate(batch):
            r = s.request
            first, last = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            tokens = r.token_ids()
            input_ids.extend(tokens[first:last])
            positions.extend(range(first, last))
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(first, last))
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(last)
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if s.samples:
                sample_rows.append(starts[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        )
        return PreparedBatch(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                             torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                             torch.tensor(sample_rows, dtype=torch.int64, device=dev),
                             [s.request for s in batch if s.samples])

    @torch.inference_mode()
    def run(self, batch: PreparedBatch) -> list[int]:
        """Forward and sampling; one sampled id per sampling request, in order."""
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sampling:
            return []
        logits = self.model.compute_logits(hidden[batch.sample_rows]).float().cpu()
        return sample(logits, batch.sampling, self.generator)
