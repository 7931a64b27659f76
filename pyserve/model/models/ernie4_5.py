"""ERNIE 4.5 dense (Ernie4_5ForCausalLM): the Llama decoder with a rotary embedding that turns
interleaved pairs of dimensions (GPT-J's layout, layers/rotary.py: InterleavedRotary) over
whole heads. Its layers run in Python (the native kernel turns halves). use_bias, which would
put biases on every projection, is a start-up error naming it."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import InterleavedRotary, RotaryEmbedding
from pyserve.model.models.llama import LlamaForCausalLM, LlamaModel


def family_config(cfg: dict) -> None:
    if cfg.get("use_bias"):
        raise ModelLoadError("config.json: ERNIE 4.5's use_bias (biases on every projection) is not "
                             "supported yet")


class Ernie4_5Model(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        if not hasattr(self, "interleaved_rotary"):  # one table for every layer, made once
            self.interleaved_rotary = InterleavedRotary(arch.head_dim, 1.0, rotary.cos.shape[0],
                                                        arch.rope_theta, arch.rope_scaling)
        layer = super().make_layer(arch, rotary, dtype, tp, i)
        layer.self_attn.rotary = self.interleaved_rotary
        return layer


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    model_class = Ernie4_5Model
