"""EXAONE 4 (Exaone4ForCausalLM): OLMo 2's post-norm layers (models/olmo2.py) with Qwen3's
per-head q/k norms; where the config sets a sliding window, three layers of four slide
(layer_types) and the global ones attend without a rotary embedding."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaAttention, LlamaForCausalLM
from pyserve.model.models.olmo2 import Olmo2DecoderLayer, Olmo2Model


class Exaone4Model(Olmo2Model):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        window = arch.layer_window(i)
        positions = rotary if arch.sliding_window is None or window else None  # global: no rope
        attention = LlamaAttention(arch, positions, dtype, tp, window)
        return Olmo2DecoderLayer(arch, positions, dtype, tp, window, attention)


class Exaone4ForCausalLM(LlamaForCausalLM):
    model_class = Exaone4Model
