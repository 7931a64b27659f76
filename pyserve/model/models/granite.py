"""IBM Granite 3 (GraniteForCausalLM): the Llama decoder with four multipliers of its config
applied where transformers applies them: the embedding scaled by embedding_multiplier, the
attention scores by attention_multiplier (in place of 1/sqrt(head_dim)), each attention and
MLP output by residual_multiplier before it joins the residual stream, and the logits divided
by logits_scaling. The layers run in Python (the native layer has no multipliers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class GraniteMultipliers:
    embedding: float
    attention: float
    residual: float
    logits_scaling: float


def family_config(cfg: dict) -> GraniteMultipliers:
    """transformers' defaults for the keys a config leaves out."""
    return GraniteMultipliers(embedding=float(cfg.get("embedding_multiplier", 1.0)),
                              attention=float(cfg.get("attention_multiplier", 1.0)),
                              residual=float(cfg.get("residual_multiplier", 1.0)),
                              logits_scaling=float(cfg.get("logits_scaling", 1.0)))


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None):
        super().__init__(arch, rotary, dtype, tp, window)
        self.self_attn = LlamaAttention(arch, rotary, dtype, tp, window, scale=arch.family.attention)
        self.residual_multiplier = arch.family.residual

    def make_native(self) -> None:
        """No native call: it has no residual multiplier."""

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    def __init__(self, arch: ModelArch, *args, **kwargs):
        super().__init__(arch, *args, **kwargs)
        self.embedding_multiplier = arch.family.embedding

    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        return GraniteDecoderLayer(arch, rotary, dtype, tp, arch.layer_window(i))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.arch.family.logits_scaling
