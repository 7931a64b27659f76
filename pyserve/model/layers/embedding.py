"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.layers.parallel import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = min(self.rows_per_rank, loaded.shape[0] - self.vocab_start)
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            raise NotImplementedError("tensor-parallel embedding arrives with the TP executor")
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over this rank's vocabulary rows; shares the embedding when tied."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
