"""Hybrid linear attention: Qwen3-Next and Qwen3.5 (dense and MoE, text only). Three layers in
four (layer_types, else every full_attention_interval-th layer is full) are Gated DeltaNet
linear attention (layers/linear_attention.py) with a fixed-size state per sequence in the state
pool; the others are gated full attention over the paged KV cache: q_proj yields each head's
query and an output gate (sigmoid), q and k are RMS-normalised per head, and the rotary
embedding turns only the first partial_rotary_factor of each head. Every RMSNorm but the
DeltaNet's output norm is zero-centred (x · (1 + w), as Gemma's). The MLP is dense (Qwen3.5)
or the MoE block with a gated shared expert (Qwen3-Next, Qwen3.5-MoE; layers/moe.py).

Their config reading lives here (hf_config: a multimodal Qwen3.5's text_config, flat;
family_config: the linear layers' shapes; moe_spec). Checkpoints: Qwen3-Next merges q, k, v
and z (and b, a) per key head (in_proj_qkvz, in_proj_ba), Qwen3.5 keeps them apart
(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a); both load into one projection ordered
q | k | v | z | b | a. A multimodal checkpoint's language_model weights load, its vision tower
is not served.

Served on one rank, without pipeline stages, prefix caching or speculative decoding (a
sequence's recurrent state cannot be taken from a cached prefix or rolled back to the last
accepted draft yet): executor/plan.py refuses or turns them off at start-up, saying so."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.attention import AttentionMetadata, PagedAttention
from pyserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyserve.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pyserve.model.layers.linear_attention import (causal_conv, chunked_delta_rule, gated_rms_norm,
                                                   recurrent_delta_rule_)
from pyserve.model.layers.moe import MoeSpec, SparseMoe
from pyserve.model.layers.norm import GemmaRMSNorm
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import LlamaMLP
from pyserve.model.models.moe import MoeForCausalLM

logger = logging.getLogger("pyserve")

CONDITIONAL = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
MOE = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
KINDS = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridSpec:
    """ModelArch.family of a hybrid: its layer kinds and the linear layers' shapes."""

    layer_kinds: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    rotary_dim: int  # of each full-attention head, the first rotary_dim dimensions turn
    merged_per_key_head: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba layout
    # a qwen35 GGUF's value heads in tiled order: value head h reads key head h % Hk (grouped,
    # Hugging Face's order: h // (Hv / Hk))
    tiled_value_heads: bool = False

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == "linear_attention")

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's state over every linear layer: the convolution's last inputs (in
        the activations' dtype) and the float32 recurrent state."""
        conv = self.conv_channels * (self.conv_kernel - 1) * dtype.itemsize
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim * 4
        return len(self.linear_layers) * (conv + recurrent)


def hf_config(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's keys as model/arch.py reads them: a multimodal checkpoint's text_config
    flat (its vision tower is not served); Qwen3.5-MoE's dense size (it has no dense layer)."""
    if architecture in CONDITIONAL:
        text = dict(cfg.get("text_config") or {})
        for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        cfg = {**text, "architectures": [architecture]}
    if architecture.startswith("Qwen3_5Moe") and "intermediate_size" not in cfg:
        cfg = {**cfg, "intermediate_size": int(cfg.get("moe_intermediate_size", 512))}
    rope = dict(cfg.get("rope_parameters") or {})
    if rope.get("rope_type", "default") not in ("default", None):
        raise ModelLoadError(f"config.json: rope scaling '{rope['rope_type']}' on a hybrid "
                             "linear-attention model is not supported yet")
    return cfg


def family_config(cfg: dict[str, Any]) -> HybridSpec:
    layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval", 4))
        kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if len(kinds) != layers or not set(kinds) <= set(KINDS):
        raise ModelLoadError(f"config.json: layer_types must name 'linear_attention' or "
                             f"'full_attention' for each of the {layers} layers")
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    spec = HybridSpec(
        tuple(kinds), int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32)),
        int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128)),
        int(cfg.get("linear_conv_kernel_dim", 4)), int(head_dim * _rotary_share(cfg)),
        str(cfg["architectures"][0]) == "Qwen3NextForCausalLM", bool(cfg.get(TILED_KEY, False)))
    if spec.num_value_heads % spec.num_key_heads:
        raise ModelLoadError(f"config.json: linear_num_value_heads ({spec.num_value_heads}) must be a "
                             f"multiple of linear_num_key_heads ({spec.num_key_heads})")
    if spec.rotary_dim % 2 or spec.rotary_dim <= 0:
        raise ModelLoadError(f"config.json: partial_rotary_factor gives {spec.rotary_dim} rotary "
                             f"dimensions of a head of {head_dim}; they must be even and positive")
    return spec


def _rotary_share(cfg: dict[str, Any]) -> float:
    """partial_rotary_factor: in rope_parameters (transformers 5) or flat (older configs);
    transformers' default for these models is a quarter of each head."""
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))


def moe_spec(architecture: str, cfg: dict[str, Any], num_layers: int) -> MoeSpec | None:
    """The MoE block of Qwen3-Next and Qwen3.5-MoE (a gated shared expert each; Qwen3.5-MoE
    renormalises the top k always, Qwen3-Next as norm_topk_prob says); None for dense Qwen3.5."""
    if architecture not in MOE:
        return None
    experts = int(cfg.get("num_experts", 512 if architecture == "Qwen3NextForCausalLM" else 256))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    spec = MoeSpec(num_experts=experts, top_k=int(cfg.get("num_experts_per_tok", 10 if architecture
                                                          == "Qwen3NextForCausalLM" else 8)),
                   expert_size=int(cfg.get("moe_intermediate_size", 512)),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) or architecture != "Qwen3NextForCausalLM",
                   sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                       for i in range(num_layers)),
                   shared_expert_size=int(cfg.get("shared_expert_intermediate_size", 512)))
    if not 1 <= spec.top_k <= spec.num_experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok {spec.top_k} must be between 1 and "
                             f"the {spec.num_experts} experts")
    return spec


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArch, spec: HybridSpec, dtype: torch.dtype):
        super().__init__()
        self.spec = spec
        hk, hv, dk, dv = spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        # q | k | v (the convolved channels) | z (the output gate), and b (beta) | a (the
        # decay) apart: a GGUF keeps the small b and a in types of their own
        self.in_proj_qkvz = ColumnParallelLinear(arch.hidden_size, [self.key_dim, self.key_dim, self.value_dim,
                                                                    self.value_dim], False, dtype)
        self.in_proj_ba = ColumnParallelLinear(arch.hidden_size, [hv, hv], False, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(spec.conv_channels, 1, spec.conv_kernel, dtype=dtype),
                                          requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(hv, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(hv, dtype=dtype), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv, dtype=dtype), requires_grad=False)
        self.eps = arch.rms_norm_eps
        self.out_proj = RowParallelLinear(self.value_dim, arch.hidden_size, False, dtype)
        self.conv_state: torch.Tensor | None = None  # [slots, C, K - 1], set by allocate_state
        self.recurrent_state: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] float32

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        s = self.spec
        self.conv_state = torch.zeros(num_slots, s.conv_channels, s.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(num_slots, s.num_value_heads, s.key_head_dim, s.value_head_dim,
                                           dtype=torch.float32, device=device)

    def _copy_states(self, pairs: list[tuple[int, int]] | None) -> None:
        for source, destination in pairs or ():
            self.conv_state[destination] = self.conv_state[source]
            self.recurrent_state[destination] = self.recurrent_state[source]

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self._copy_states(meta.state_copy_in)  # prefix hits resume from their checkpoints
        out = self._forward(hidden, meta)
        self._copy_states(meta.state_copy_out)  # checkpoints kept at block boundaries
        return out

    def _forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.spec
        hk, hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim
        mixed, z = self.in_proj_qkvz(hidden).split([2 * self.key_dim + self.value_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba(hidden).split([hv, hv], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        core = torch.empty(hidden.shape[0], hv, dv, dtype=torch.float32, device=hidden.device)
        starts = meta.query_start_loc.tolist()
        if meta.state_slots is None:  # a dummy step (profiling, warm-up): fresh, in any rows
            slots = [i % self.conv_state.shape[0] for i in range(len(starts) - 1)]
            fresh = [True] * len(slots)
        else:
            slots, fresh = meta.state_slots.tolist(), meta.state_fresh.tolist()
        decode = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1 and not fresh[i]]
        if decode:  # one token each, resumed: their convolutions batched, then each state in its slot
            rows = torch.tensor([starts[i] for i in decode], device=hidden.device)
            index = torch.tensor([slots[i] for i in decode], device=hidden.device)
            x = mixed[rows]  # [B, C]
            window = torch.cat([self.conv_state[index], x.unsqueeze(-1).to(self.conv_state.dtype)], dim=-1)
            self.conv_state[index] = window[:, :, 1:]
            conv = nn.functional.silu((window.to(x.dtype) * weight).sum(-1))
            q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q, k, v = q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)
            for j, i in enumerate(decode):  # each slot's state updated where it lies
                slot = slots[i]
                core[starts[i]] = recurrent_delta_rule_(
                    q[j:j + 1], k[j:j + 1], v[j:j + 1], g[starts[i]:starts[i] + 1], beta[starts[i]:starts[i] + 1],
                    self.recurrent_state[slot:slot + 1], s.tiled_value_heads)[0]
        for i in sorted(set(range(len(slots))) - set(decode)):
            r0, r1, slot = starts[i], starts[i + 1], slots[i]
            if fresh[i]:
                previous = torch.zeros_like(self.conv_state[slot])
                state = torch.zeros_like(self.recurrent_state[slot])
            else:
                previous, state = self.conv_state[slot], self.recurrent_state[slot]
            conv, self.conv_state[slot] = causal_conv(mixed[r0:r1], previous, weight)
            q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            n = r1 - r0
            core[r0:r1], self.recurrent_state[slot] = chunked_delta_rule(
                q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g[r0:r1], beta[r0:r1], state,
                s.tiled_value_heads)
        out = gated_rms_norm(core.to(hidden.dtype), z.reshape(-1, hv, dv), self.norm.weight, self.eps)
        return self.out_proj(out.reshape(hidden.shape[0], self.value_dim))


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields an output gate per head (sigmoid), with
    zero-centred per-head q/k norms and rope over the first rotary_dim of each head."""

    def __init__(self, arch: ModelArch, spec: HybridSpec, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        d = arch.head_dim
        # q_proj's rows: per head, d of query then d of gate, loaded whole as the q part
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, d, 2 * arch.num_heads, arch.num_kv_heads,
                                          arch.attention_bias, dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, False, dtype)
        self.q_norm = GemmaRMSNorm(d, arch.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(d, arch.rms_norm_eps, dtype)
        self.rotary, self.rotary_dim = rotary, spec.rotary_dim
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, d, d ** -0.5)

    def _turn(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.rotary.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rotary.sin[positions].unsqueeze(1).to(x.dtype)
        turned = RotaryEmbedding._rotate(x[..., :self.rotary_dim], cos, sin)
        return torch.cat([turned, x[..., self.rotary_dim:]], dim=-1)

    def forward(self, positions, hidden, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        kv = self.num_kv_heads * d
        q_gate, k, v = self.qkv_proj(hidden).split([2 * h * d, kv, kv], dim=-1)
        q, gate = q_gate.view(t, h, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.reshape(t, self.num_kv_heads, d))
        q, k = self._turn(positions, q), self._turn(positions, k)
        v = v.reshape(t, self.num_kv_heads, d).contiguous()
        out = self.attn(q.contiguous(), k.contiguous(), v, kv_cache, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, h * d)))


class HybridDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, i: int):
        super().__init__()
        spec: HybridSpec = arch.family
        self.is_linear = spec.layer_kinds[i] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(arch, spec, dtype)
        else:
            self.self_attn = GatedAttention(arch, spec, rotary, dtype)
        moe = arch.moe
        if moe is not None and moe.sparse_layers[i]:
            shared = LlamaMLP(dataclasses.replace(arch, intermediate_size=moe.shared_expert_size), dtype, SINGLE)
            self.mlp = SparseMoe(arch.hidden_size, moe, dtype, shared)
        else:
            self.mlp = LlamaMLP(arch, dtype, SINGLE)
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, kv_cache, meta: AttentionMetadata):
        """transformers' order: the residual added, then normalised (its adds are commutative)."""
        residual = hidden if residual is None else hidden + residual
        hidden = self.input_layernorm(residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(positions, hidden, kv_cache, meta)
        residual = hidden + residual
        return self.mlp(self.post_attention_layernorm(residual)), residual


class HybridModel(nn.Module):
    num_carried = 2

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__()
        self.stage = stage
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, tp)
        rotary = RotaryEmbedding(arch.family.rotary_dim, max_positions, arch.rope_theta, None)
        self.layers = nn.ModuleList(HybridDecoderLayer(arch, rotary, dtype, i) for i in range(arch.num_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, carried=None):
        """kv_caches: the full-attention layers' caches, in order."""
        hidden, residual = self.embed_tokens(input_ids), None
        caches = iter(kv_caches)
        for layer in self.layers:
            cache = None if layer.is_linear else next(caches)
            hidden, residual = layer(positions, hidden, residual, cache, meta)
        return self.norm(hidden + residual)


# Qwen3-Next's merged projections: per key head, q (Dk) | k (Dk) | v (r Dv) | z (r Dv), and
# b (r) | a (r), r = Hv / Hk value heads per key head
_MERGED = re.compile(r"(model\.layers\.\d+\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight")
_APART = re.compile(r"(model\.layers\.\d+\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight")


class HybridForCausalLM(MoeForCausalLM):
    model_class = HybridModel
    # the step's sequences and state slots are read on the host: no CUDA graph holds that
    graph_capturable = False

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        nn.Module.__init__(self)
        if tp.size != 1 or not (stage.is_first and stage.is_last):
            raise ModelLoadError(f"{arch.architecture}: its linear-attention layers run on one rank "
                                 "without pipeline stages")
        self.arch, self.stage, self.tp = arch, stage, tp
        self.model = HybridModel(arch, max_positions, dtype, tp, stage)
        self.lm_head = (self.model.embed_tokens if arch.tie_word_embeddings
                        else ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, tp))
        spec = arch.family
        logger.info("%s: %d linear-attention layers (Gated DeltaNet: %d key, %d value heads of %d / "
                    "%d) and %d full-attention layers%s", arch.architecture, len(spec.linear_layers),
                    spec.num_key_heads, spec.num_value_heads, spec.key_head_dim, spec.value_head_dim,
                    arch.num_layers - len(spec.linear_layers),
                    "" if arch.moe is None else "; " + arch.moe.describe(arch.hidden_size))

    def linear_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """The state pool: num_slots slots in every linear layer (kv/manager.py hands them out)."""
        for layer in self.linear_layers():
            layer.allocate_state(num_slots, dtype, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        spec: HybridSpec = self.arch.family
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def renamed():
            for name, tensor in weights:
                if name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
                    continue
                for old in ("model.language_model.", "language_model.model."):
                    if name.startswith(old):
                        name = "model." + name[len(old):]
                merged, apart = _MERGED.fullmatch(name), _APART.fullmatch(name)
                if merged is not None:
                    qkvz = merged[2] == "in_proj_qkvz"
                    target = f"{merged[1]}.{merged[2]}.weight"
                    for shard, part in enumerate(_split_per_key_head(tensor, spec, qkvz)):
                        params[target].weight_loader(params[target], part, shard)
                    loaded.add(target)
                    continue
                if apart is not None:
                    which = apart[2]
                    target = f"{apart[1]}.in_proj_{'qkvz' if which in ('qkv', 'z') else 'ba'}.weight"
                    key = spec.num_key_heads * spec.key_head_dim
                    if which == "qkv":  # q | k | v rows, as narrow()s of the tensor (or its blocks)
                        for shard, (start, size) in enumerate([(0, key), (key, key),
                                                               (2 * key, tensor.shape[0] - 2 * key)]):
                            params[target].weight_loader(params[target], tensor.narrow(0, start, size), shard)
                    else:
                        params[target].weight_loader(params[target], tensor, {"z": 3, "b": 0, "a": 1}[which])
                    loaded.add(target)
                    continue
                if name.endswith("linear_attn.conv1d.weight") and name in params:
                    params[name].data.copy_(tensor[...].reshape(params[name].shape))
                    loaded.add(name)
                    continue
                yield name, tensor

        return loaded | super().load_weights(renamed())


def _split_per_key_head(weight, spec: HybridSpec, qkvz: bool) -> list:
    """Qwen3-Next's merged rows, grouped per key head, as our parts' rows: [q, k, v, z] or
    [b, a] (a GGUF's blocks are regrouped by whole rows)."""
    from pyserve.model.layers.quantized import GGUFBlocks

    hk, r = spec.num_key_heads, spec.num_value_heads // spec.num_key_heads
    sizes = ([spec.key_head_dim, spec.key_head_dim, r * spec.value_head_dim, r * spec.value_head_dim]
             if qkvz else [r, r])
    if isinstance(weight, GGUFBlocks):
        rows = torch.arange(weight.shape[0]).reshape(hk, sum(sizes))
        return [GGUFBlocks(weight.type, weight.blocks[part.reshape(-1)], (part.numel(), weight.shape[1]))
                for part in rows.split(sizes, dim=1)]
    weight = weight[...]
    grouped = weight.reshape(hk, sum(sizes), weight.shape[-1])
    return [part.reshape(-1, weight.shape[-1]) for part in grouped.split(sizes, dim=1)]


# a qwen35 / qwen35moe GGUF holds the value heads tiled ([K0, K1, .., K0, K1, ..] by key head)
# where Hugging Face groups them by key head: its config says so under this key
TILED_KEY = "pyserve_tiled_value_heads"


def gguf_config(get, gguf_arch: str, cfg: dict) -> dict:
    """config.json's keys of a hybrid GGUF from its metadata (get(key, default): the value of
    "{gguf_arch}.{key}"): the linear layers' shapes (llama.cpp's ssm.* keys), which layers
    are recurrent, the rotary share of a head, and the layers without the multi-token
    prediction blocks llama.cpp appends (nextn_predict_layers, not served)."""
    value_heads = int(get("ssm.time_step_rank"))
    key_heads = int(get("ssm.group_count"))
    layers = int(get("block_count")) - int(get("nextn_predict_layers", 0) or 0)
    out = {"num_hidden_layers": layers, "linear_num_value_heads": value_heads,
           "linear_num_key_heads": key_heads, "linear_key_head_dim": int(get("ssm.state_size")),
           "linear_value_head_dim": int(get("ssm.inner_size")) // value_heads,
           "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                               "partial_rotary_factor": int(get("rope.dimension_count")) / cfg["head_dim"]}}
    recurrent = get("attention.recurrent_layers")
    if recurrent is not None:
        out["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        out["full_attention_interval"] = int(get("full_attention_interval", 4))
    if gguf_arch != "qwen3next" and value_heads != key_heads:
        out[TILED_KEY] = True
    return out


def untile_value_heads(tensors: dict, cfg: dict) -> None:
    """A qwen35 GGUF's float32 tensors, in place, with the value heads grouped by key head as
    Hugging Face holds them (the reference checkpoint convert_gguf writes)."""
    hk, hv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    dv, key = int(cfg["linear_value_head_dim"]), hk * int(cfg["linear_key_head_dim"])

    def grouped(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], hv // hk, hk, size, *shape[dim + 1:])
        return t.transpose(dim, dim + 1).reshape(shape).contiguous()

    for name in list(tensors):
        if ".linear_attn." not in name:
            continue
        t = tensors[name]
        if name.endswith("in_proj_qkv.weight"):
            tensors[name] = torch.cat([t[:2 * key], grouped(t[2 * key:], 0, dv)])
        elif name.endswith("in_proj_z.weight"):
            tensors[name] = grouped(t, 0, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            tensors[name] = grouped(t, 0, 1)
        elif name.endswith("conv1d.weight"):
            tensors[name] = torch.cat([t[:2 * key], grouped(t[2 * key:], 0, dv)])
        elif name.endswith("out_proj.weight"):
            tensors[name] = grouped(t, 1, dv)


def reference_tensors(tensors: dict, cfg: dict) -> dict:
    """A hybrid GGUF's float32 tensors as transformers loads them (convert_gguf's reference
    checkpoint): value heads grouped by key head, the convolution [C, 1, K], and Qwen3-Next's
    q, k, v and z (which llama.cpp splits) merged per key head again into in_proj_qkvz."""
    if cfg.get(TILED_KEY):
        untile_value_heads(tensors, cfg)
    hk, dk = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    out = {}
    for name, t in tensors.items():
        if name.endswith("linear_attn.conv1d.weight"):
            t = t.reshape(t.shape[0], 1, -1)
        if cfg["architectures"][0] == "Qwen3NextForCausalLM" and name.endswith("in_proj_qkv.weight"):
            z = tensors[name.replace("in_proj_qkv", "in_proj_z")]
            q, k, v = t[:hk * dk], t[hk * dk:2 * hk * dk], t[2 * hk * dk:]
            per_head = [x.reshape(hk, -1, t.shape[1]) for x in (q, k, v, z)]
            out[name.replace("in_proj_qkv", "in_proj_qkvz")] = torch.cat(per_head, dim=1).reshape(-1, t.shape[1])
            continue
        if cfg["architectures"][0] == "Qwen3NextForCausalLM" and name.endswith("in_proj_z.weight"):
            continue
        out[name] = t
    return out
