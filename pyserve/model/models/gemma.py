"""The Gemma 2 and Gemma 3 text decoders (Gemma3ForConditionalGeneration checkpoints served
text-only). Shapes: T tokens in the step, H query heads, Hkv KV heads, D head size.

How they differ from the Llama family (llama.py), as transformers computes them:
- the embedding is scaled by sqrt(hidden_size), a constant rounded to the activation dtype;
- RMSNorm is x_normed * (1 + weight), and each sublayer's output is normalised again before
  the residual add (pre/post attention and pre/post feed-forward norms);
- Gemma 3 normalises q and k per head (the same (1 + weight) norm) before rotary;
- the MLP is gelu_tanh(gate) * up; head_dim is its own config value; the attention scale is
  query_pre_attn_scalar ** -0.5;
- layers are local (sliding window) or global per ModelArch.layer_types; Gemma 3's local
  layers use rope base rope_local_theta, its global ones rope_theta with the config's scaling;
- Gemma 2 softcaps attention scores (in the paged kernel) and final logits: c * tanh(x / c).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pyserve import _native
from pyserve.model.arch import ModelArch
from pyserve.model.layers.activation import gelu_tanh_and_mul
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.layers.embedding import VocabParallelEmbedding
from pyserve.model.layers.linear import native_linear
from pyserve.model.layers.norm import GemmaRMSNorm
from pyserve.model.layers.parallel import WHOLE_MODEL, PipelineStage, TPGroup
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.models.llama import (AbsentLayer, KVCache, LlamaAttention, LlamaForCausalLM,
                                        LlamaMLP, needs_embedding, stage_layers)

# checkpoint prefixes of a multimodal Gemma 3's text model (transformers 5, then 4) -> ours
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_UNSERVED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")


def gemma_attention(arch: ModelArch, rotary: RotaryEmbedding, window: int | None,
                    dtype: torch.dtype, tp: TPGroup) -> LlamaAttention:
    """Llama's attention with Gemma's q/k norm, query_pre_attn_scalar and softcap."""
    return LlamaAttention(arch, rotary, dtype, tp, window, norm=GemmaRMSNorm,
                          scale=(arch.query_pre_attn_scalar or arch.head_dim) ** -0.5,
                          softcap=arch.attn_logit_softcapping)


def gemma_mlp(arch: ModelArch, dtype: torch.dtype, tp: TPGroup) -> LlamaMLP:
    if arch.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma hidden_activation '{arch.hidden_activation}' is not supported "
                         "(supported: gelu_pytorch_tanh)")
    return LlamaMLP(arch, dtype, tp, activation=gelu_tanh_and_mul)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, rotary: RotaryEmbedding, window: int | None,
                 dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = gemma_attention(arch, rotary, window, dtype, tp)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = gemma_mlp(arch, dtype, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.tp = tp
        # kv_group -> the whole layer as one native call (make_native); the group, which
        # names the block tables of the layer's cache, is known once the caches are
        self.native_layer = None

    def make_native(self) -> None:
        """As LlamaDecoderLayer.make_native: one native call (_native.GemmaLayer, the same
        ops in the same order) where the layer has one rank, packed weights and no bias
        outside qkv. Called after weights_loaded, so the norms' 1 + w are known."""
        attn, mlp = self.self_attn, self.mlp
        linears = [native_linear(l) for l in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                              mlp.down_proj)]
        norms = [self.input_layernorm, self.post_attention_layernorm,
                 self.pre_feedforward_layernorm, self.post_feedforward_layernorm]
        if attn.q_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
        if (self.tp.size != 1 or None in linears
                or any(n.frozen_scale is None or n.eps != norms[0].eps for n in norms)
                or any(l.bias is not None for l in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj))):
            return
        self.native_layer = lambda kv_group: _native.GemmaLayer(
            [n.frozen_scale for n in norms[:4]],
            attn.q_norm.frozen_scale if attn.q_norm is not None else None,
            attn.k_norm.frozen_scale if attn.k_norm is not None else None,
            norms[0].eps, *linears, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            attn.rotary.cos_sin, attn.attn.scale, attn.attn.window or 0, attn.attn.softcap or 0.0,
            kv_group)

    def forward(self, positions, hidden, kv_cache: KVCache, meta: AttentionMetadata):
        """hidden: the residual stream [T, hidden_size] -> the next layer's."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    num_carried = 1  # the residual stream is the hidden state: all a pipeline stage hands on

    def __init__(self, arch: ModelArch, max_positions: int, dtype: torch.dtype, tp: TPGroup,
                 stage: PipelineStage = WHOLE_MODEL):
        super().__init__()
        self.stage = stage
        if needs_embedding(arch, stage):
            self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, tp)
        # a 0-dim tensor of the activation dtype, as transformers multiplies by
        self.register_buffer("normalizer", torch.tensor(arch.hidden_size ** 0.5, dtype=dtype),
                             persistent=False)
        rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope_scaling)
        local = rotary  # Gemma 2: one rope for every layer
        if arch.rope_local_theta is not None:
            local = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta, None)
        def layer(i: int) -> GemmaDecoderLayer:
            window = arch.layer_window(i)
            return GemmaDecoderLayer(arch, local if window else rotary, window, dtype, tp)

        self.layers = stage_layers(arch, stage, layer)
        self.own_layers = [m for m in self.layers if not isinstance(m, AbsentLayer)]
        if stage.is_last:
            self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self._stack = None  # (caches, layers' native calls, the stack or None): native_stack

    def native_stack(self, kv_caches: list[KVCache]):
        """This stage's layers as one native call on these caches (_native.GemmaStack), or
        None where a layer is not native. Built on the first step (the caches, and so each
        layer's KV group, come after the weights), again if the caches or a layer change."""
        natives = [layer.native_layer for layer in self.own_layers]
        if (self._stack is None or self._stack[0] is not kv_caches
                or any(a is not b for a, b in zip(self._stack[1], natives))):
            stack = None
            if natives and len(kv_caches) == len(natives) and None not in natives:
                stack = _native.GemmaStack(
                    [make(getattr(cache, "group", 0)) for make, cache in zip(natives, kv_caches)],
                    [cache[0] for cache in kv_caches], [cache[1] for cache in kv_caches])
            self._stack = (kv_caches, natives, stack)
        return self._stack[2]

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata,
                carried: tuple[torch.Tensor, ...] | None = None):
        """carried: the previous pipeline stage's (hidden,) on a later stage. -> the final
        hidden states on the last stage, (hidden,) for the next stage on the others."""
        if carried is None:
            hidden = self.embed_tokens(input_ids) * self.normalizer
        else:
            (hidden,) = carried
        stack = self.native_stack(kv_caches)
        if stack is not None:
            if meta.group_block_tables is None:  # one KV group
                slots, tables = meta.slot_mapping.unsqueeze(0), meta.block_tables.unsqueeze(0)
            else:
                slots, tables = meta.group_slot_mapping, meta.group_block_tables
            hidden = stack.forward(positions, hidden, slots, tables, meta.query_start_loc,
                                   meta.seq_lens)
        else:
            for layer, kv_cache in zip(self.own_layers, kv_caches):
                hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden) if self.stage.is_last else (hidden,)


class GemmaForCausalLM(LlamaForCausalLM):
    """The Llama wrapper (LM head, tied embeddings, stacked-weight loading) around GemmaModel,
    with Gemma 2's final logit softcap and a multimodal checkpoint's text model renamed."""

    model_class = GemmaModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, vocab] on rank 0 (softcapped where the config says); None on the other ranks."""
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_text_weights(weights))


def _text_weights(weights):
    """A checkpoint's tensors under the text model's names; the vision tower's left out."""
    for name, tensor in weights:
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        if not name.startswith(_UNSERVED) and "rotary_emb." not in name:
            yield name, tensor
