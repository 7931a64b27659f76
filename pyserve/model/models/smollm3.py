"""SmolLM3: the Llama decoder where every fourth layer (by default) attends without a rotary
embedding (NoPE), as its config's no_rope_layers says (1: rope, 0: none). Its sliding window
applies only with use_sliding_window, as Qwen2's (model/arch.py)."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaForCausalLM, LlamaModel


def family_config(cfg: dict) -> tuple[int, ...]:
    """ModelArch.family: the layers without rope."""
    return nope_layers(cfg, int(cfg["num_hidden_layers"]))


def nope_layers(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """The layers without rope: no_rope_layers' zeros, else every no_rope_layer_interval-th
    layer (transformers' default)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ModelLoadError(f"config.json: no_rope_layers must have one entry for each of the "
                             f"{num_layers} layers")
    return tuple(i for i, rope in enumerate(flags) if not rope)


class SmolLM3Model(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        layer = super().make_layer(arch, rotary, dtype, tp, i)
        if i in arch.family:
            layer.self_attn.rotary = None
        return layer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_class = SmolLM3Model
