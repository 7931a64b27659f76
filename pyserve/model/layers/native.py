"""The decoder layers as the native stack runs them (csrc/cpu/decoder_layer.h). A layer is a
spec built from its Python modules: where its norms sit ("pre": Llama's, "sandwich": Gemma's),
its attention (q/k norm kind, rope, window, softcap) and its MLP (dense gated or a mixture of
experts). Each native piece runs the kernels of the module it stands for in the same order,
so a stack of specs is bitwise the Python layers; a module without a native twin (a bias the
piece lacks, another rope, tensor parallelism, weights the CPU kernels did not pack) gives
None and its layer stays in Python.

The model owns a NativeStack, which turns its layers' specs into one _native.DecoderStack a
step (one call, one release of the GIL for every layer) once the KV caches are known."""

from __future__ import annotations

import torch

from pyserve import _native
from pyserve.model.layers.activation import gelu_tanh_and_mul, silu_and_mul
from pyserve.model.layers.linear import native_linear
from pyserve.model.layers.norm import GemmaRMSNorm, RMSNorm
from pyserve.model.layers.rotary import RotaryEmbedding

# the gated MLPs' activations with a native twin
_ACTIVATIONS = {silu_and_mul: "silu", gelu_tanh_and_mul: "gelu_tanh"}


def norm_weight(norm, eps: float) -> torch.Tensor | None:
    """What the native norm multiplies by: RMSNorm's weight, GemmaRMSNorm's 1 + w; None for
    another norm or another eps than the layer's."""
    if norm.eps != eps:
        return None
    if type(norm) is RMSNorm:
        return norm.weight
    if type(norm) is GemmaRMSNorm:
        return norm.frozen_scale
    return None


def attention_spec(attn, qk_norm: str, eps: float):
    """_native.AttentionSpec of an attention module with LlamaAttention's parts (qkv_proj,
    o_proj, q_norm, k_norm, rotary, attn); qk_norm: how its q/k norms apply ("per_head",
    "projection"; Gemma's norm class makes "per_head" a contiguous one). None where a part has
    no native twin."""
    qkv, o_proj = native_linear(attn.qkv_proj), native_linear(attn.o_proj)
    if qkv is None or o_proj is None or attn.o_proj.bias is not None:
        return None
    if attn.rotary is not None and type(attn.rotary) is not RotaryEmbedding:  # the kernel's: neox, whole heads
        return None
    kind, q_norm, k_norm = _native.QkNorm.none, None, None
    if attn.q_norm is not None:
        q_norm, k_norm = norm_weight(attn.q_norm, eps), norm_weight(attn.k_norm, eps)
        if q_norm is None or k_norm is None or type(attn.q_norm) is not type(attn.k_norm):
            return None
        if qk_norm == "projection":
            kind = _native.QkNorm.projection
        elif type(attn.q_norm) is GemmaRMSNorm:
            kind = _native.QkNorm.per_head_contiguous
        else:
            kind = _native.QkNorm.per_head
    paged = attn.attn
    return _native.AttentionSpec(qkv, o_proj, attn.num_heads, attn.num_kv_heads, attn.head_dim, kind,
                                 q_norm, k_norm, None if attn.rotary is None else attn.rotary.cos_sin,
                                 paged.scale, paged.window or 0, paged.softcap or 0.0)


def dense_mlp_spec(mlp):
    """_native.DenseMlp of a LlamaMLP (gate_up_proj, down_proj, activation), or None."""
    gate_up, down = native_linear(mlp.gate_up_proj), native_linear(mlp.down_proj)
    activation = _ACTIVATIONS.get(mlp.activation)
    if gate_up is None or down is None or activation is None:
        return None
    if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return None
    return _native.DenseMlp(gate_up, down, activation)


def moe_spec(moe, shared_expert_spec=None):
    """_native.MoeMlp of a SparseMoe whose experts pack_experts packed (one rank), or None;
    shared_expert_spec: its shared expert's DenseMlp where it has one."""
    if moe.packed_down is None or moe.tp.size != 1 or moe.gate.bias is not None:
        return None
    shared_gate = None
    if moe.shared_expert is not None:
        if shared_expert_spec is None or moe.shared_expert_gate.bias is not None:
            return None
        shared_gate = moe.shared_expert_gate.weight
    return _native.MoeMlp(moe.gate.weight, moe.top_k, moe.norm_topk_prob, moe.packed_gate_up,
                          moe.packed_down, shared_expert_spec, shared_gate)


def layer_spec(placement: str, norms, eps: float, attention, mlp=None, moe=None):
    """_native.LayerSpec, or None where a piece is None (a layer then stays in Python)."""
    weights = [norm_weight(n, eps) for n in norms]
    if attention is None or (mlp is None and moe is None) or None in weights:
        return None
    return _native.LayerSpec(placement, weights, eps, attention, mlp, moe)


class NativeStack:
    """A pipeline stage's layers as one _native.DecoderStack on their KV caches, built on the
    first step (the caches come after the weights) and again when the caches or a layer's
    spec change; it holds the caches it was built on until then. None where a layer has no
    spec (its `native` is None)."""

    def __init__(self):
        self._built = None  # (caches, specs, the stack or None)

    def __call__(self, layers, kv_caches):
        specs = [layer.native for layer in layers]
        if (self._built is None or self._built[0] is not kv_caches
                or any(a is not b for a, b in zip(self._built[1], specs))):
            stack = None
            if specs and len(kv_caches) == len(specs) and None not in specs:
                stack = _native.DecoderStack(specs, [cache[0] for cache in kv_caches],
                                             [cache[1] for cache in kv_caches],
                                             [getattr(cache, "group", 0) for cache in kv_caches])
            self._built = (kv_caches, specs, stack)
        return self._built[2]


def run_layer(spec, positions, hidden, residual, kv_cache, meta):
    """One layer's native spec on its own (buffers of its own): -> (hidden, residual), the
    residual None after a sandwich-normed layer."""
    slot_mapping, block_tables = meta.for_group(getattr(kv_cache, "group", 0))
    return _native.decoder_layer(spec, positions, hidden, residual, kv_cache[0], kv_cache[1],
                                 slot_mapping, block_tables, meta.query_start_loc, meta.seq_lens)
