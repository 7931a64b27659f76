"""One step on the device: scheduled requests -> input tensors -> forward -> sampled ids."""

from __future__ import annotations

import torch

from pyserve.engine.scheduler import ScheduledRequest
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.sampler import sample


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, device: torch.device,
                 seed: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def _prepare(self, batch: list[ScheduledRequest]):
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
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta,
                torch.tensor(sample_rows, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledRequest]) -> list[int]:
        """Runs the batch; returns one sampled id per request whose step samples, in order."""
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if sample_rows.numel() == 0:
            return []
        logits = self.model.compute_logits(hidden[sample_rows]).float().cpu()
        return sample(logits, [s.request for s in batch if s.samples], self.generator)
