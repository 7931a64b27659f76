"""Token embedding and LM head, split by vocabulary rows across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.arith import cdiv
from pyserve import _native
from pyserve.model.layers.linear import apply_linear
from pyserve.model.layers.parallel import SINGLE, TPGroup
from pyserve.model.layers.quantized import source_tensor, weight_destination


# Logits of up to this many rows (a decode step's batch) are written into a buffer the layer
# keeps (logits()): a fresh [rows, vocab] tensor each step is fresh memory each step, which the
# kernel maps, faults in and zeroes page by page. Gemma 3's 262,144-token vocabulary at 16
# rows is 16.8 MB a step: 8 % of the server's samples in a W2 run went to those page faults.
# More rows (prompt logprobs) allocate as before rather than keep that much.
REUSED_LOGITS_ROWS = 64


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.dtype = dtype  # of the activations; the table may be stored narrower
        self.rows_per_rank = cdiv(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self._load
        self.packed = None  # set by pack_for_cpu
        self.gguf = None  # GGUF blocks loaded in place of weight (layers/quantized.py)
        self._logits_buffer: torch.Tensor | None = None  # logits()'s, grown to the rows seen

    def _load(self, param: nn.Parameter, loaded) -> None:
        rows = max(0, min(self.rows_per_rank, loaded.shape[0] - self.vocab_start))
        destination = weight_destination(self, param, loaded)
        if rows:
            destination[:rows].copy_(source_tensor(loaded.narrow(0, self.vocab_start, rows)))
        destination[rows:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight).to(self.dtype)
        return _native.packed_rows(self.packed, ids.contiguous()).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        # each rank looks up the ids in its rows and contributes zeros for the others
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[n, vocab_size] on rank 0, None on the other ranks: only rank 0 samples. With the
        packed CPU kernel and at most REUSED_LOGITS_ROWS rows, the logits are a view of a
        buffer the next call overwrites: they are the step's, used before the next step."""
        if self.tp.size == 1:
            return apply_linear(hidden, self, out=self._reused_out(hidden))[:, :vocab_size]
        gathered = self.tp.gather_to_first(apply_linear(hidden, self))  # [size, n, rows]
        if gathered is None:
            return None
        return gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, :vocab_size]


    def _reused_out(self, hidden: torch.Tensor) -> torch.Tensor | None:
        rows = hidden.shape[0]
        if (self.packed is None or rows > min(REUSED_LOGITS_ROWS, self.max_packed_rows)
                or hidden.dtype != torch.float32):
            return None
        size = rows * self.out_features
        if self._logits_buffer is None or self._logits_buffer.numel() < size:
            self._logits_buffer = torch.empty(size, dtype=torch.float32)
        return self._logits_buffer[:size].view(rows, self.out_features)


class ParallelLMHead(VocabParallelEmbedding):
    """The untied output projection; a tied model computes logits with its embedding."""
