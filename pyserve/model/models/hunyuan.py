"""Hunyuan dense (HunYuanDenseV1ForCausalLM): the Llama decoder with per-head q/k norms applied
after the rotary embedding (Qwen3 applies them before), named query_layernorm and
key_layernorm, and a rope whose base NTK-alpha stretches: the checkpoints' "dynamic" scaling
with a fixed alpha, a static base theta * alpha^(d / (d - 2)), as transformers reads it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.norm import RMSNorm
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel


def family_config(cfg: dict) -> float | None:
    """The stretched rope base, where the rope is NTK-alpha; else None (the config's own)."""
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) != "dynamic" or not rope.get("alpha"):
        return None
    dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return theta * rope["alpha"] ** (dim / (dim - 2))


class NormAfterRopeAttention(LlamaAttention):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None):
        super().__init__(arch, rotary, dtype, tp, window)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, dtype)

    def forward(self, positions, hidden, kv_cache, meta):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class HunYuanModel(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        layer = super().make_layer(arch, rotary, dtype, tp, i)
        layer.self_attn = NormAfterRopeAttention(arch, rotary, dtype, tp, arch.layer_window(i))
        return layer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunYuanModel

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        if arch.family is not None:  # NTK-alpha: a plain rope of the stretched base
            arch = dataclasses.replace(arch, rope_theta=arch.family, rope_scaling=None)
        super().__init__(arch, max_positions, dtype, tp, stage)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((name.replace(".query_layernorm.", ".q_norm.").replace(".key_layernorm.", ".k_norm."),
                    tensor) for name, tensor in weights)
        return super().load_weights(renamed)
