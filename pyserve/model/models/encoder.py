"""An encoder (models/bert.py) behind the interface the model runner drives decoders by:
forward(input_ids, positions, kv_caches, meta) -> hidden states. It reads only the step's
sequence boundaries from the attention metadata (it attends within each whole sequence and
keeps no KV cache), and has no logits: it serves pooling requests only."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.models.bert import BertEmbeddingModel, EncoderArch


class EncoderForEmbedding(nn.Module):
    def __init__(self, arch: EncoderArch, dtype: torch.dtype):
        super().__init__()
        self.arch = arch
        self.encoder = BertEmbeddingModel(arch, dtype)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        # the encoder reads the boundaries on the host each layer: one copy a step, not one each
        return self.encoder(input_ids, positions, meta.query_start_loc.cpu())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.arch.architecture} is an encoder: it has no logits to sample")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {f"encoder.{name}" for name in self.encoder.load_weights(weights)}
