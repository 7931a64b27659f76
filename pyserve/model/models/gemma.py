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
from typing import Any

import torch
from torch import nn

from pyserve.errors import ModelLoadError
from pyserve.model.arch import ModelArch
from pyserve.model.layers.activation import gelu_tanh_and_mul
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.layers.embedding import VocabParallelEmbedding
from pyserve.model.layers.native import NativeStack, layer_spec, run_layer
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
        self.native = None  # the layer's native spec (make_native), None: it runs in Python

    def make_native(self) -> None:
        """As LlamaDecoderLayer.make_native, with the norms around each sublayer. Called after
        weights_loaded, so the norms' 1 + w are known."""
        if self.tp.size != 1 or type(self).forward is not GemmaDecoderLayer.forward:
            return
        eps = self.input_layernorm.eps
        norms = [self.input_layernorm, self.post_attention_layernorm,
                 self.pre_feedforward_layernorm, self.post_feedforward_layernorm]
        self.native = layer_spec("sandwich", norms, eps, self.self_attn.native_spec(eps),
                                 mlp=self.mlp.native_spec())

    def forward(self, positions, hidden, kv_cache: KVCache, meta: AttentionMetadata):
        """hidden: the residual stream [T, hidden_size] -> the next layer's."""
        if self.native is not None:
            return run_layer(self.native, positions, hidden, None, kv_cache, meta)[0]
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
        self._native_stack = NativeStack()

    def native_stack(self, kv_caches: list[KVCache]):
        """This stage's layers as one native call on these caches (layers/native.py), or None."""
        return self._native_stack(self.own_layers, kv_caches)

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
            hidden, _ = stack.forward(positions, hidden, None, *meta.all_groups(),
                                      meta.query_start_loc, meta.seq_lens)
        else:
            for layer, kv_cache in zip(self.own_layers, kv_caches):
                hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden) if self.stage.is_last else (hidden,)


# transformers' defaults for the keys a Gemma config.json may leave out (Gemma 3 multimodal
# checkpoints give only a few in text_config)
_GEMMA3 = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
               num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True,
               query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0,
               rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh",
               bos_token_id=2, eos_token_id=1)
_GEMMA_DEFAULTS = {
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "Gemma2ForCausalLM": {**_GEMMA3, "vocab_size": 256_000, "max_position_embeddings": 8192,
                          "rope_theta": 10_000.0, "rope_local_base_freq": None,
                          "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
}


def hf_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's keys as model/arch.py reads them: the text model's, flat (a multimodal
    Gemma 3's text_config; its vision tower is not served), transformers' defaults filled in,
    rope_parameters keyed by layer type (transformers 5) split into the global rope and the
    local base, and layer_types by Gemma's rule where the config has none (every Nth layer
    global, the others local)."""
    if arch == "Gemma3ForConditionalGeneration":
        text = dict(cfg.get("text_config") or {})
        for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
            if key not in text and key in cfg:
                text[key] = cfg[key]
        cfg = {**text, "architectures": [arch]}
    defaults = _GEMMA_DEFAULTS[arch]
    cfg = {**defaults, **cfg}
    for key in ("rope_theta", "rope_local_base_freq"):  # written as null by some savers
        if cfg.get(key) is None:
            cfg[key] = defaults[key]
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        glob, local = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling '{local['rope_type']}' on sliding layers is not supported")
        cfg["rope_theta"] = glob.pop("rope_theta", cfg["rope_theta"])
        cfg["rope_local_base_freq"] = local.get("rope_theta", cfg["rope_local_base_freq"])
        cfg["rope_parameters"] = glob
    elif "rope_theta" in rope:  # one rope for all layers (Gemma 2): not the default filled in above
        cfg["rope_theta"] = rope["rope_theta"]
    if cfg.get("layer_types") is None:
        pattern = int(cfg.get("sliding_window_pattern") or (2 if arch.startswith("Gemma2") else 6))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(int(cfg["num_hidden_layers"]))]
    return cfg


def gguf_config(get, gguf_arch: str, cfg: dict) -> dict:
    """Gemma's config.json keys from a GGUF's metadata (get(key, default): the value of
    "{gguf_arch}.{key}"), and llama.cpp's rules for the ones it does not carry (transformers
    fills those with its config defaults instead; they agree except for the attention scale of
    a model whose head_dim is not 256)."""
    num_layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    gemma = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        # llama.cpp scales scores by head_dim ** -0.5, except in Gemma 3 27B (62 layers) and
        # Gemma 2 27B (46 layers), whose checkpoints use hidden / heads
        "query_pre_attn_scalar": (cfg["hidden_size"] // cfg["num_attention_heads"]
                                  if num_layers in (46, 62) else head_dim),
        "sliding_window": int(get("attention.sliding_window", 4096)),
        "sliding_window_pattern": int(get("attention.sliding_window_pattern",
                                          2 if gguf_arch == "gemma2" else 6)),
    }
    if gguf_arch == "gemma2":
        gemma["attn_logit_softcapping"] = float(get("attn_logit_softcapping", 50.0))
        gemma["final_logit_softcapping"] = float(get("final_logit_softcapping", 30.0))
    else:
        gemma["rope_local_base_freq"] = 10_000.0  # llama.cpp's constant for the local layers
        factor = get("rope.scaling.factor")
        if factor is not None and get("rope.scaling.type", "linear") == "linear":
            gemma["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return gemma


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
