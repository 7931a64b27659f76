"""OLMo 2 (Olmo2ForCausalLM): the Llama decoder's attention and MLP with their norms after them
instead of before (each sublayer's output is normalised, then added to the residual stream),
and q and k normalised over all their heads at once. The layers run in Python (the native
layer is pre-norm)."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.norm import RMSNorm
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import (LlamaForCausalLM, LlamaMLP, LlamaModel,
                                        ProjectionNormedAttention)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None, attention: nn.Module | None = None):
        """attention: another family's (EXAONE 4's per-head q/k norms); OLMo's by default."""
        super().__init__()
        self.self_attn = attention or ProjectionNormedAttention(arch, rotary, dtype, tp, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(arch, dtype, tp)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.native = None

    def make_native(self) -> None:
        """No native call: the native layer is pre-norm."""

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """(hidden, residual) as the Llama layers hand them on: the stream is their sum. Returns
        the MLP's normalised output and the stream before it (the next layer, or the final
        norm, adds them)."""
        stream = hidden if residual is None else hidden + residual
        attended = self.post_attention_layernorm(self.self_attn(positions, stream, kv_cache, meta))
        stream = stream + attended
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2Model(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        return Olmo2DecoderLayer(arch, rotary, dtype, tp, arch.layer_window(i))


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
