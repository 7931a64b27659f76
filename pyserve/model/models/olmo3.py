"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's layers (models/olmo2.py) with sliding-window attention on
three layers of four (its layer_types) and a rope per kind of layer: the full layers' base and
scaling (YaRN on the long-context checkpoints), the sliding layers' plain base."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch, fill_original_positions
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaForCausalLM
from pyserve.model.models.olmo2 import Olmo2DecoderLayer, Olmo2Model

DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config.default_theta


@dataclass(frozen=True)
class Olmo3Rope:
    theta: float  # the full layers'
    scaling: dict | None  # the full layers'
    local_theta: float  # the sliding layers' (never scaled)


def family_config(cfg: dict) -> Olmo3Rope:
    """rope_parameters keyed by layer kind (transformers 5), or a flat rope_theta and
    rope_scaling, which transformers gives the full layers only: the sliding ones then keep
    the default base, as its config conversion does."""
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        full, local = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
    else:
        full, local = {**(cfg.get("rope_scaling") or {}), **rope}, {}
        full.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError("config.json: OLMo 3's sliding layers take no rope scaling")
    theta = float(full.pop("rope_theta", DEFAULT_THETA))
    full["rope_type"] = full.get("rope_type", full.get("type", "default"))
    scaling = None if full["rope_type"] == "default" else full
    if scaling is not None and scaling["rope_type"] in ("yarn", "llama3"):
        fill_original_positions(scaling, cfg)
    return Olmo3Rope(theta, scaling, float(local.get("rope_theta", DEFAULT_THETA)))


class Olmo3Model(Olmo2Model):
    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        window = arch.layer_window(i)
        if window and not hasattr(self, "local_rotary"):  # the sliding layers' rope, made once
            self.local_rotary = RotaryEmbedding(arch.head_dim, rotary.cos.shape[0], arch.family.local_theta,
                                                None)
        return Olmo2DecoderLayer(arch, self.local_rotary if window else rotary, dtype, tp, window)


class Olmo3ForCausalLM(LlamaForCausalLM):
    model_class = Olmo3Model

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        # the full layers' rope is the one LlamaModel makes from rope_theta and rope_scaling
        arch = dataclasses.replace(arch, rope_theta=arch.family.theta, rope_scaling=arch.family.scaling)
        super().__init__(arch, max_positions, dtype, tp, stage)
