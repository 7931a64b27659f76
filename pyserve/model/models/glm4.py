"""GLM-4 (Glm4ForCausalLM, the 0414 models): the Llama decoder's projections (q/k/v biases, the
gate and up projections one checkpoint tensor, as Phi-3's) with four norms per layer (before
and after attention, before and after the MLP), and a rotary embedding over the first half of
each head (partial_rotary_factor) that turns interleaved pairs of dimensions (GPT-J's layout)
rather than the two halves. The layers run in Python."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.norm import RMSNorm
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import InterleavedRotary, RotaryEmbedding
from pyserve.model.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from pyserve.model.models.phi3 import Phi3ForCausalLM


def family_config(cfg: dict) -> float:
    """The share of each head the rotary embedding turns (transformers' default: half)."""
    rope = cfg.get("rope_parameters") or {}
    return float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5)))


class Glm4DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: InterleavedRotary, dtype: torch.dtype,
                 tp: TPGroup, window: int | None):
        super().__init__()
        norm = lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm, self.post_self_attn_layernorm = norm(), norm()
        self.post_attention_layernorm, self.post_mlp_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(arch, rotary, dtype, tp, window)
        self.mlp = LlamaMLP(arch, dtype, tp)
        self.native = None

    def make_native(self) -> None:
        """No native call: four norms and an interleaved partial rope."""

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """(hidden, residual) summed are the stream, as models/olmo2.py hands them on."""
        stream = hidden if residual is None else hidden + residual
        attended = self.self_attn(positions, self.input_layernorm(stream), kv_cache, meta)
        stream = stream + self.post_self_attn_layernorm(attended)
        return self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(stream))), stream


class Glm4Model(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        if not hasattr(self, "partial_rotary"):  # one table for every layer, made once
            self.partial_rotary = InterleavedRotary(arch.head_dim, arch.family, rotary.cos.shape[0],
                                                    arch.rope_theta, arch.rope_scaling)
        return Glm4DecoderLayer(arch, self.partial_rotary, dtype, tp, arch.layer_window(i))


class Glm4ForCausalLM(Phi3ForCausalLM):  # Phi-3's loading cuts the fused gate_up_proj
    model_class = Glm4Model
