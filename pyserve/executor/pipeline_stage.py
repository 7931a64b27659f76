"""The model as one pipeline stage's rank runs it, behind the interface ModelRunner drives
(forward -> hidden states, compute_logits), so that the runner, the sampler and the ranks'
step loops are the same with and without pipeline parallelism.

One step (every rank has the step's inputs from the world broadcast), cut into micro-batches
of whole sequences (pipeline_micro_batches.py), each of which goes through the stages in turn:
    stage 0          per micro-batch: embed, its layers, send (hidden[, residual]) to stage 1
    stage s          per micro-batch: receive from stage s-1, its layers, send to stage s+1
    last stage       per micro-batch: receive, its layers, final norm; then the step's logits
                     rows (gathered to its tp rank 0, which sends them to rank 0 at once)
    rank 0           after its last send, receives the logits and samples
So stage 0 runs micro-batch 2 while stage 1 runs micro-batch 1. The logits go back only after
the last micro-batch: were the last stage to send a micro-batch's logits at once, it would
wait for rank 0 while rank 0 waited for it to take the next micro-batch. Every rank decides
from the same inputs.logits_rows whether the step has logits at all (the runner skips
compute_logits when it has none), so the sends and receives always pair up. Only one step is
in flight: overlapping consecutive steps would need the engine to schedule the next step
before the last one's tokens are sampled."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.executor.pipeline import StageLinks
from pyserve.executor.pipeline_micro_batches import join_hidden, split_micro_batches
from pyserve.model.layers.parallel import PipelineStage


class PipelineStageModel(nn.Module):
    def __init__(self, model: nn.Module, stage: PipelineStage, links: StageLinks,
                 dtype: torch.dtype, micro_batches: int = 1):
        super().__init__()
        self.micro_batches = micro_batches  # at most; 1: no overlap between stages
        self.model = model
        self.arch = model.arch
        self.stage = stage
        self.links = links
        self.dtype = dtype  # of the carried activations

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """-> the final hidden states on the last stage; on the others, this stage's hidden
        states (sent on; only their row count is used here)."""
        parts = [self._forward_micro_batch(input_ids[mb.tokens], positions[mb.tokens], kv_caches,
                                           mb.meta)
                 for mb in split_micro_batches(meta, self.micro_batches)]
        return join_hidden(parts)

    def _forward_micro_batch(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        carried = None
        if not self.stage.is_first:
            shape = (self.model.num_carried, input_ids.shape[0], self.arch.hidden_size)
            carried = tuple(self.links.from_previous.receive(shape, self.dtype).unbind(0))
        out = self.model(input_ids, positions, kv_caches, meta, carried)
        if self.stage.is_last:
            return out
        self.links.to_next.send(torch.stack(out))
        return out[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the last stage's logits of hidden's rows, received; the last stage: computed
        (and sent to rank 0 from its tp rank 0); the other ranks: None."""
        if self.stage.is_last:
            logits = self.model.compute_logits(hidden)
            if logits is not None:  # the stage's tp rank 0
                logits = logits.float()
                self.links.logits.send(logits)
            return logits
        if self.stage.is_first and self.links.tp_rank == 0:
            return self.links.logits.receive((hidden.shape[0], self.arch.vocab_size), torch.float32)
        return None
