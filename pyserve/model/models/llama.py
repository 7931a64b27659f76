"""The Llama-family decoder: Llama 2/3 (and SmolLM2), Mistral, Qwen2 (qkv bias) and Qwen3
(q/k RMSNorm). Shapes: T tokens in the step, H query heads, Hkv KV heads, D head size.

Under pipeline parallelism each stage builds only its own layers (the others are weightless
placeholders, so that checkpoint names keep their layer numbers), the embedding on the first
stage and the final norm and LM head on the last; a stage hands the next its (hidden,
residual) pair."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pyserve.model.arch import ModelArch
from pyserve.model.layers.activation import silu_and_mul
from pyserve.model.layers.attention import AttentionMetadata, PagedAttention
from pyserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pyserve.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pyserve.model.layers.native import (NativeStack, attention_spec, dense_mlp_spec, layer_spec,
                                         run_layer)
from pyserve.model.layers.norm import RMSNorm
from pyserve.model.layers.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.loader import fill_parameter

KVCache = tuple[torch.Tensor, torch.Tensor]

# checkpoint name fragment -> (our merged parameter, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None = None, norm=RMSNorm, scale: float | None = None,
                 softcap: float | None = None):
        """norm: the q/k norm's class (Qwen3's RMSNorm, Gemma's (1 + w) one); scale: the
        scores' scale (None: 1 / sqrt(head_dim)); softcap: Gemma 2's attention softcap."""
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, d, arch.num_heads, arch.num_kv_heads,
                                          arch.attention_bias, dtype, tp)
        self.num_heads = tp.shard(arch.num_heads, "num_attention_heads")
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, False, dtype, tp)
        self.q_norm = norm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = norm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d,
                                   d ** -0.5 if scale is None else scale, window, softcap)
        self.head_dim = d

    def forward(self, positions, hidden, kv_cache: KVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:  # None: a layer without positions (SmolLM3's NoPE layers)
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def native_spec(self, eps: float):
        """The native twin of this forward (layers/native.py), or None; a subclass that
        computes otherwise has none unless it says so."""
        if type(self).forward is not LlamaAttention.forward:
            return None
        return attention_spec(self, "per_head", eps)


class ProjectionNormedAttention(LlamaAttention):
    """OLMo 2's and OLMoE's attention: q and k RMS-normalised over all their heads at once,
    before the heads are split (Qwen3 normalises each head)."""

    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None = None):
        super().__init__(arch, rotary, dtype, tp, window)
        if tp.size != 1:  # the norm spans every head: a rank holds only some
            raise ValueError(f"{arch.architecture}: its q/k norms span all heads; serve it on one "
                             "tensor-parallel rank")
        self.q_norm = RMSNorm(self.q_size, arch.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.kv_size, arch.rms_norm_eps, dtype)

    def forward(self, positions, hidden, kv_cache: KVCache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.contiguous()).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k.contiguous()).view(-1, self.num_kv_heads, self.head_dim)
        v = v.contiguous().view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))

    def native_spec(self, eps: float):
        if type(self).forward is not ProjectionNormedAttention.forward:
            return None
        return attention_spec(self, "projection", eps)


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, dtype: torch.dtype, tp: TPGroup, activation=silu_and_mul):
        """activation: the gated MLP's (SiLU here, GELU-tanh for Gemma)."""
        super().__init__()
        n = arch.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(arch.hidden_size, [n, n], False, dtype, tp)
        self.down_proj = RowParallelLinear(n, arch.hidden_size, False, dtype, tp)
        self.activation = activation

    def forward(self, x):
        return self.down_proj(self.activation(self.gate_up_proj(x)))

    def native_spec(self):
        return dense_mlp_spec(self) if type(self).forward is LlamaMLP.forward else None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                 window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(arch, rotary, dtype, tp, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(arch, dtype, tp)
        self.tp = tp
        self.native = None  # the layer's native spec (make_native), None: it runs in Python

    def make_native(self) -> None:
        """The layer as a native spec (layers/native.py: the same kernels in the same order,
        bitwise this forward) where every piece has one: one rank, the weights packed for the
        CPU, no bias outside qkv, the neox rope or none. Called once the weights are packed."""
        if self.tp.size != 1 or type(self).forward is not LlamaDecoderLayer.forward:
            return
        eps = self.input_layernorm.eps
        self.native = layer_spec("pre", [self.input_layernorm, self.post_attention_layernorm], eps,
                                 self.self_attn.native_spec(eps), **self.native_mlp())

    def native_mlp(self) -> dict:
        """layer_spec's mlp (or moe) argument: this layer's MLP's native twin."""
        return {"mlp": self.mlp.native_spec()}

    def forward(self, positions, hidden, residual, kv_cache: KVCache, meta: AttentionMetadata):
        if self.native is not None:
            return run_layer(self.native, positions, hidden, residual, kv_cache, meta)
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class AbsentLayer(nn.Module):
    """A decoder layer another pipeline stage runs: no weights here."""


def stage_layers(arch: ModelArch, stage: PipelineStage, make_layer) -> nn.ModuleList:
    """All arch.num_layers positions; make_layer(i) for this stage's, AbsentLayer elsewhere."""
    return nn.ModuleList(make_layer(i) if stage.owns_layer(i) else AbsentLayer()
                         for i in range(arch.num_layers))


def needs_embedding(arch: ModelArch, stage: PipelineStage) -> bool:
    """The first stage embeds; the last holds the embedding as its LM head when tied."""
    return stage.is_first or (stage.is_last and arch.tie_word_embeddings)


class LlamaModel(nn.Module):
    # what one pipeline stage hands the next: (hidden, residual), [T, hidden_size] each
    num_carried = 2

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__()
        self.stage = stage
        if needs_embedding(arch, stage):
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, tp)
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        self.layers = stage_layers(arch, stage, lambda i: self.make_layer(arch, rotary, dtype, tp, i))
        self.own_layers = [m for m in self.layers if not isinstance(m, AbsentLayer)]
        if stage.is_last:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self._native_stack = NativeStack()

    def make_layer(self, arch: ModelArch, rotary: RotaryEmbedding, dtype: torch.dtype, tp: TPGroup,
                   i: int) -> nn.Module:
        """Decoder layer i (a family whose layers differ overrides this: models/moe.py)."""
        return LlamaDecoderLayer(arch, rotary, dtype, tp, arch.layer_window(i))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input (a family that scales it overrides this: models/granite.py)."""
        return self.embed_tokens(input_ids)

    def native_stack(self, kv_caches: list[KVCache]):
        """This stage's layers as one native call on these caches, or None where a layer has
        no native spec (layers/native.py's NativeStack)."""
        return self._native_stack(self.own_layers, kv_caches)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                carried: tuple[torch.Tensor, ...] | None = None):
        """kv_caches: this stage's layers' caches, in order; carried: the previous stage's
        (hidden, residual) on a later stage. -> the final hidden states [T, hidden_size] on
        the last stage, (hidden, residual) for the next stage on the others."""
        hidden, residual = (self.embed(input_ids), None) if carried is None else carried
        stack = self.native_stack(kv_caches)
        if stack is not None:
            hidden, residual = stack.forward(positions, hidden, residual, *meta.all_groups(),
                                             meta.query_start_loc, meta.seq_lens)
        else:
            for layer, kv_cache in zip(self.own_layers, kv_caches):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.stage.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel  # the decoder stack (GemmaForCausalLM names its own)

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup = SINGLE,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__()
        self.arch = arch
        self.stage = stage
        self.model = self.model_class(arch, max_positions, dtype, tp, stage)
        self.lm_head = None  # a stage before the last has no head
        if stage.is_last:
            self.lm_head = (self.model.embed_tokens if arch.tie_word_embeddings
                            else ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, tp))

    @property
    def num_carried(self) -> int:
        return self.model.num_carried

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                carried: tuple[torch.Tensor, ...] | None = None):
        """-> hidden states [T, hidden_size]; on a pipeline stage before the last, the
        tensors the next stage continues from (LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, meta, carried)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, vocab] on rank 0; None on the other tensor-parallel ranks."""
        return self.lm_head.logits(hidden, self.arch.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies checkpoint tensors into place; returns the parameter names filled. A weight
        may be a tensor or a not-yet-read checkpoint slice (narrow() and [...] read it)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            target, shard = name, None
            for fragment, (merged, shard_id) in _STACKED.items():
                if f".{fragment}." in name:
                    target, shard = name.replace(fragment, merged), shard_id
                    break
            param = params.get(target)
            if param is None:
                continue  # tensors the model does not use (e.g. extra heads)
            fill_parameter(param, tensor, shard)
            loaded.add(target)
        return loaded
