"""Mixtures of experts on the Llama-family decoder: Qwen3-MoE (q/k norm), Qwen2-MoE (qkv bias,
a gated shared expert), Mixtral and OLMoE (q and k normalised over the whole projection). Each MoE layer's MLP is layers/moe.py's SparseMoe; layers
the config keeps dense (mlp_only_layers, decoder_sparse_step) keep the Llama MLP.

Their config reading lives here: moe_spec for config.json, gguf_config for a GGUF's metadata.
Checkpoints name each expert's weights apart (experts.{e}.gate_proj / up_proj / down_proj,
Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2), stacked as transformers 5 holds them
(experts.gate_up_proj, experts.down_proj) or stacked per projection as a GGUF holds them
(experts.gate_proj / up_proj / down_proj, kept in the file's quantized blocks); all load.

On the CPU the experts run as one native call over their packed weights (layers/moe.py's
pack_experts and fused_moe). Tensor parallelism splits each expert's intermediate size across the ranks
(vLLM's default), pipeline parallelism splits the layers as for any decoder."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable

import torch

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.moe import MoeSpec, SparseMoe
from pyserve.model.layers.native import moe_spec as moe_native_spec
from pyserve.model.layers.quantized import GGUFExperts
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.models.llama import (LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel,
                                        ProjectionNormedAttention)

logger = logging.getLogger("pyserve")

# a per-expert checkpoint name -> (layer, expert, which part of gate_up_proj / down_proj)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_STACKED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# a GGUF's stacked experts, one projection each (model/gguf.py): [E, I, H] gate and up,
# [E, H, I] down, as float32 tensors or the file's blocks
_GGUF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")


def _num_experts(cfg: dict, default: int) -> int:
    # hub configs say num_experts (Mixtral's num_local_experts); transformers 5 writes
    # num_local_experts for every one of them
    value = cfg.get("num_experts", cfg.get("num_local_experts"))
    return default if value is None else int(value)


def moe_spec(architecture: str, cfg: dict, num_layers: int) -> MoeSpec:
    """The MoE shape of a config.json (transformers' defaults for the keys it leaves out); a
    layout this block cannot run is a ModelLoadError naming the key."""
    spec = _read_spec(architecture, cfg, num_layers)
    if not 1 <= spec.top_k <= spec.num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {spec.top_k} must be between 1 and "
                             f"the {spec.num_experts} experts")
    if spec.expert_size <= 0 or (spec.shared_expert_size is not None and spec.shared_expert_size <= 0):
        raise ModelLoadError("config.json: the experts' intermediate sizes must be positive")
    return spec


def _read_spec(architecture: str, cfg: dict, num_layers: int) -> MoeSpec:
    if architecture == "MixtralForCausalLM":
        return MoeSpec(num_experts=_num_experts(cfg, 8),
                       top_k=int(cfg.get("num_experts_per_tok", 2)),
                       expert_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                       sparse_layers=(True,) * num_layers)
    if architecture == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ModelLoadError("config.json: OLMoE's clip_qkv is not supported yet")
        return MoeSpec(num_experts=_num_experts(cfg, 64), top_k=int(cfg.get("num_experts_per_tok", 8)),
                       expert_size=int(cfg["intermediate_size"]),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       sparse_layers=(True,) * num_layers)
    qwen2 = architecture == "Qwen2MoeForCausalLM"
    experts = _num_experts(cfg, 60 if qwen2 else 128)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoeSpec(num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 4 if qwen2 else 8)),
                   expert_size=int(cfg.get("moe_intermediate_size", 1408 if qwen2 else 768)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=sparse,
                   shared_expert_size=(int(cfg.get("shared_expert_intermediate_size", 5632))
                                       if qwen2 else None))


# llama.cpp's graph for each MoE architecture renormalises the top-k weights (qwen3moe and
# Mixtral's llama) or not (qwen2moe, olmoe), whatever the original config said
_GGUF_NORM_TOPK = {"qwen3moe": True, "llama": True, "qwen2moe": False, "olmoe": False,
                   "qwen35moe": True, "qwen3next": True}


def gguf_config(get, gguf_arch: str, cfg: dict, tensor_names: set[str]) -> dict:
    """A MoE GGUF's config.json keys (moe_spec reads them), from its metadata (get(key,
    default): the value of "{gguf_arch}.{key}") and its tensors' names. llama.cpp's layers
    without a router (ffn_gate_inp) are dense; its graphs fix whether the top-k weights are
    renormalised (_GGUF_NORM_TOPK)."""
    if gguf_arch not in _GGUF_NORM_TOPK:
        raise ModelLoadError(f"GGUF architecture '{gguf_arch}' with experts is not supported")
    per_expert = sorted(n for n in tensor_names if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n))
    if per_expert:
        raise ModelLoadError(
            f"this GGUF stores each expert as a tensor of its own ({per_expert[0]}, an early "
            "llama.cpp layout); pyserve reads the merged ffn_*_exps tensors: convert it again "
            "with a current llama.cpp")
    experts = int(get("expert_count"))
    expert_size = int(get("expert_feed_forward_length", 0) or cfg["intermediate_size"])
    moe = {"num_experts": experts, "num_local_experts": experts,
           "num_experts_per_tok": int(get("expert_used_count")),
           "norm_topk_prob": _GGUF_NORM_TOPK[gguf_arch]}
    if gguf_arch == "llama":
        moe.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   intermediate_size=expert_size)
        return moe
    if gguf_arch == "olmoe":
        moe["intermediate_size"] = expert_size
        return moe
    moe["moe_intermediate_size"] = expert_size
    moe["decoder_sparse_step"] = 1
    moe["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"])
                              if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    if gguf_arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        moe["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    return moe


class MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, arch: ModelArch, rotary, dtype: torch.dtype, tp: TPGroup, window: int | None):
        super().__init__(arch, rotary, dtype, tp, window)
        if arch.architecture == "OlmoeForCausalLM":
            self.self_attn = ProjectionNormedAttention(arch, rotary, dtype, tp, window)
        spec = arch.moe
        shared = None
        if spec.shared_expert_size is not None:
            shared = LlamaMLP(dataclasses.replace(arch, intermediate_size=spec.shared_expert_size),
                              dtype, tp)
        self.mlp = SparseMoe(arch.hidden_size, spec, dtype, shared, tp)

    def native_mlp(self) -> dict:
        moe = self.mlp
        shared = moe.shared_expert.native_spec() if moe.shared_expert is not None else None
        return {"moe": moe_native_spec(moe, shared)}


class MoeModel(LlamaModel):
    def make_layer(self, arch: ModelArch, rotary, dtype: torch.dtype, tp: TPGroup, i: int):
        if arch.moe.sparse_layers[i]:
            return MoeDecoderLayer(arch, rotary, dtype, tp, arch.layer_window(i))
        return super().make_layer(arch, rotary, dtype, tp, i)


class MoeForCausalLM(LlamaForCausalLM):
    model_class = MoeModel
    # the experts a step runs are read from its routing on the host: no CUDA graph holds that
    graph_capturable = False

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__(arch, max_positions, dtype, tp, stage)
        self.tp = tp
        logger.info("%s: %s", arch.architecture, arch.moe.describe(arch.hidden_size))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The experts' weights into their stacked parameters (a stacked parameter counts as
        loaded once every expert's part of it is); the rest as the Llama decoder loads it,
        Mixtral's block_sparse_moe named mlp."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}  # stacked parameter -> expert parts copied into it
        projections: dict[int, set[str]] = {}  # layer -> a GGUF's stacked projections read
        loaded: set[str] = set()

        def rest():
            for name, tensor in weights:
                expert = _EXPERT.fullmatch(name)
                if expert is not None:
                    layer, e, part = int(expert[1]), int(expert[2]), _PART[expert[3]]
                    experts = f"model.layers.{layer}.mlp.experts."
                    target = experts + ("down_proj" if part == 2 else "gate_up_proj")
                    param = params.get(target)
                    if param is None:
                        continue
                    n = param.shape[2] if part == 2 else param.shape[1] // 2  # this rank's share
                    if part == 2:  # [H, I]: this rank's columns
                        param.data[e].copy_(tensor.narrow(1, self.tp.rank * n, n))
                    else:  # [I, H]: this rank's rows, into the gate or the up half
                        param.data[e, part * n:(part + 1) * n].copy_(tensor.narrow(0, self.tp.rank * n, n))
                    filled[target] = filled.get(target, 0) + 1
                    continue
                gguf = _GGUF_EXPERTS.fullmatch(name)
                if gguf is not None:
                    layer = int(gguf[1])
                    if f"model.layers.{layer}.mlp.experts.down_proj" in params:
                        self._load_gguf_experts(layer, gguf[2], tensor, params)
                        projections.setdefault(layer, set()).add(gguf[2])
                    continue
                stacked = _STACKED_EXPERTS.fullmatch(name)
                if stacked is not None and name in params:
                    self._load_stacked(params[name], tensor, stacked[2])
                    loaded.add(name)
                    continue
                yield name.replace(".block_sparse_moe.", ".mlp."), tensor

        loaded |= super().load_weights(rest())
        for target, parts in filled.items():
            param = params[target]
            if parts == param.shape[0] * (1 if target.endswith("down_proj") else 2):
                loaded.add(target)
        for layer, read in projections.items():
            experts = f"model.layers.{layer}.mlp.experts."
            if {"gate_proj", "up_proj"} <= read:
                loaded.add(experts + "gate_up_proj")
            if "down_proj" in read:
                loaded.add(experts + "down_proj")
        return loaded

    def _load_gguf_experts(self, layer: int, projection: str, tensor, params: dict) -> None:
        """A GGUF's stacked experts of one projection: this rank's rows of gate and up (into
        their half of gate_up_proj), its inputs of down; the file's blocks are kept for
        pack_experts (layers/moe.py), float32 tensors copied into the parameters."""
        moe = self.model.layers[layer].mlp
        rank, n = self.tp.rank, moe.expert_size
        if projection == "down_proj":
            param = params[f"model.layers.{layer}.mlp.experts.down_proj"]
            share = tensor.narrow(2, rank * n, n)
        else:
            param = params[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
            share = tensor.narrow(1, rank * n, n)
        if isinstance(share, GGUFExperts):
            moe.expert_blocks[projection.removesuffix("_proj")] = share
            if param.numel():  # the float parameter is never filled: no memory for it
                param.data = param.data.new_empty(0)
        elif projection == "down_proj":
            param.data.copy_(share)
        else:
            half = 0 if projection == "gate_proj" else 1
            param.data[:, half * n:(half + 1) * n].copy_(share)

    def _load_stacked(self, param: torch.nn.Parameter, tensor, which: str) -> None:
        """transformers 5's stacked experts: gate_up_proj [E, 2I, H] (this rank's rows of
        each half), down_proj [E, H, I] (its columns)."""
        rank = self.tp.rank
        if which == "down_proj":
            n = param.shape[2]
            param.data.copy_(tensor.narrow(2, rank * n, n))
            return
        n, whole = param.shape[1] // 2, tensor.shape[1] // 2
        for half in (0, 1):
            param.data[:, half * n:(half + 1) * n].copy_(tensor.narrow(1, half * whole + rank * n, n))
