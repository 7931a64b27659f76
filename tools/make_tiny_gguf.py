"""Writes a tiny random Llama, or a tiny Qwen3-MoE (--arch qwen3moe, llama.cpp's stacked
ffn_*_exps expert tensors), as a GGUF file with its weights in chosen GGUF block types, for
tests of the quantized CPU kernels against transformers loading the same file:

    python tools/make_tiny_gguf.py OUT.gguf [--arch llama|qwen3moe|qwen2moe|olmoe|mixtral] [--types mixed|Q5_0|Q4_K|...] [--seed 0]

`mixed` spreads Q4_0, Q4_K, Q5_K and Q6_K over the layers (and keeps a few tensors in types
pyserve widens); a single type puts every linear weight and the embedding in it. The weights
are quantized with gguf.quants.quantize where the gguf package implements the type (Q4_0,
Q4_1, Q5_0, Q8_0) and with the simple encoders below for the K-quants it only dequantizes.
q and k rows are permuted as llama.cpp's converter does, so the file is laid out as a real one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# GGUF tensor role -> type per layer, for --types mixed. Layer 2 mixes q/k/v types (one merged
# parameter, so pyserve widens all three) and holds types pyserve reads widened (F16) or as
# before (Q4_1, Q8_0).
MIXED = {
    "token_embd": "Q4_K", "output": "Q6_K",
    0: dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q4_K", attn_output="Q5_K",
            ffn_gate="Q4_0", ffn_up="Q4_0", ffn_down="Q6_K"),
    1: dict(attn_q="Q6_K", attn_k="Q6_K", attn_v="Q6_K", attn_output="Q4_0",
            ffn_gate="Q5_K", ffn_up="Q5_K", ffn_down="Q4_K"),
    2: dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="F16",
            ffn_gate="Q8_0", ffn_up="Q8_0", ffn_down="Q4_1"),
}
_HF = dict(attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
           attn_output="self_attn.o_proj", ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj",
           ffn_down="mlp.down_proj", attn_norm="input_layernorm", ffn_norm="post_attention_layernorm")


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def _k_quant_levels(x: np.ndarray, levels: int):
    """x [n, 8, 32] -> (d, dmin [n, 1], sc, m [n, 8] 6-bit, q [n, 8, 32] in 0 .. levels - 1):
    w = d·sc·q - dmin·m, an asymmetric range per 32 weights, its scale and min on 6 bits."""
    low = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - low) / (levels - 1)
    d = (scale.max(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.ceil(scale / d)), 0, 63).astype(np.uint8)
        m = np.clip(np.nan_to_num(np.round(-low / dmin)), 0, 63).astype(np.uint8)
        step = (d * sc)[..., None]
        q = np.nan_to_num(np.round((x + (dmin * m)[..., None]) / step))
    return d, dmin, sc, m, np.clip(q, 0, levels - 1).astype(np.uint8)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [n, 8] -> the 12 bytes gguf's Q4_K.get_scale_min unpacks"""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _nibbles_64(q: np.ndarray) -> np.ndarray:
    """q [n, 256] -> 128 bytes: byte 32 j + i holds q[64 j + i] low, q[64 j + 32 + i] high"""
    q = q.reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_quant_levels(x.reshape(-1, 8, 32), 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m),
                           _nibbles_64(q.reshape(-1, 256))], axis=1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _k_quant_levels(x.reshape(-1, 8, 32), 32)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit s of byte i is q[32 s + i]'s fifth bit
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, m), qh,
                           _nibbles_64(q.reshape(-1, 256) & 15)], axis=1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31  # per 16 weights; q - 32 in -31 .. 31
    d = (scale.max(axis=1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.ceil(scale / d)), 0, 127).astype(np.int8)
        q = np.nan_to_num(np.round(x / (d * sc)[..., None]))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [n, half, 128]
    ql = ((q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)).reshape(-1, 128)
    bits = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (bits[:, :, 0] | (bits[:, :, 1] << 2) | (bits[:, :, 2] << 4) | (bits[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


_ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(weight: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, cols] -> GGUF blocks of type_name [rows, row bytes] (uint8), or the
    weight itself in F32 / F16."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if type_name in ("F32", "F16"):
        return weight.astype(np.float32 if type_name == "F32" else np.float16)
    if type_name in _ENCODERS:
        return _ENCODERS[type_name](weight.astype(np.float32)).reshape(weight.shape[0], -1)
    return quantize(weight.astype(np.float32), GGMLQuantizationType[type_name])


def _permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k rows -> llama.cpp's per-head interleaving (pyserve's gguf.py undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_fields(hf_dir: Path) -> tuple[list[str], list[int], list[str]]:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    for t in tok.get("added_tokens", []):
        vocab.setdefault(t["content"], t["id"])
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, [3 if i in special else 1 for i in range(len(tokens))], merges


MOE_CONFIG = dict(CONFIG, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                  norm_topk_prob=True, head_dim=64)
# --types mixed for the MoE: Q4_K_M's choices for experts (gate and up Q4_K, down Q6_K on
# some layers), a layer whose gate and up differ in type (two stacks), one of Q8_0 experts
MOE_MIXED = {
    "token_embd": "Q4_K", "output": "Q6_K",
    0: dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q4_K",
            ffn_gate_exps="Q4_K", ffn_up_exps="Q4_K", ffn_down_exps="Q6_K"),
    1: dict(attn_q="Q5_K", attn_k="Q5_K", attn_v="Q5_K", attn_output="Q5_K",
            ffn_gate_exps="Q5_K", ffn_up_exps="Q4_K", ffn_down_exps="Q4_K"),
    2: dict(attn_q="Q8_0", attn_k="Q8_0", attn_v="Q8_0", attn_output="Q4_0",
            ffn_gate_exps="Q8_0", ffn_up_exps="Q8_0", ffn_down_exps="Q5_0"),
}


def _start_writer(out_path: Path, arch: str, name: str, cfg: dict):
    """(a GGUF writer holding the keys every tiny model shares and its tokenizer, add(name,
    weight, type) that encodes a weight, [rows, cols] or stacked experts [E, rows, cols], into
    it)."""
    import gguf

    from make_tiny_model import make_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(Path(tmp))
        tokens, token_types, merges = _tokenizer_fields(Path(tmp))

    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])

    def add(tensor_name: str, weight: np.ndarray, type_name: str) -> None:
        if weight.ndim == 3:  # stacked experts: each expert's rows encoded, then stacked
            data = np.stack([encode(w, type_name) for w in weight])
        else:
            data = encode(weight, type_name)
        raw = None if type_name in ("F32", "F16") else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(tensor_name, data, raw_dtype=raw)

    return writer, add


def _type_picker(types: str, table: dict):
    """type_of(role, layer): one type for every weight, or the mixed table's."""
    def type_of(role: str, layer: int | None) -> str:
        if types != "mixed":
            return types
        return table[role] if layer is None else table[layer][role]
    return type_of


def make_tiny_gguf(out_path: str | Path, types: str = "mixed", seed: int = 0, arch: str = "llama") -> Path:
    if arch in MOE_ARCHS:
        return make_tiny_moe_gguf(out_path, types, seed, arch)
    import torch
    import transformers

    out_path = Path(out_path)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**CONFIG)
    state = {k: v.numpy() for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    type_of = _type_picker(types, MIXED)
    writer, add = _start_writer(out_path, "llama", "tiny-kquant", CONFIG)

    add("token_embd.weight", state["model.embed_tokens.weight"], type_of("token_embd", None))
    heads = {"attn_q": CONFIG["num_attention_heads"], "attn_k": CONFIG["num_key_value_heads"]}
    for i in range(CONFIG["num_hidden_layers"]):
        for role in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{role}.weight", state[f"model.layers.{i}.{_HF[role]}.weight"], "F32")
        for role in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            weight = state[f"model.layers.{i}.{_HF[role]}.weight"]
            if role in heads:
                weight = _permute_rotary(weight, heads[role])
            add(f"blk.{i}.{role}.weight", weight, type_of(role, i))
    add("output_norm.weight", state["model.norm.weight"], "F32")
    add("output.weight", state["lm_head.weight"], type_of("output", None))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


# the tiny mixtures of experts: GGUF architecture -> (transformers class names, config changes)
MOE_ARCHS = {
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {}),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(norm_topk_prob=False, shared_expert_intermediate_size=256)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(norm_topk_prob=False, intermediate_size=256)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(intermediate_size=256, num_local_experts=8)),
}


def make_tiny_moe_gguf(out_path: str | Path, types: str = "mixed", seed: int = 0,
                       arch: str = "qwen3moe") -> Path:
    """A tiny Qwen3-MoE as llama.cpp lays it out: q/k norms, a float32 router
    (ffn_gate_inp) and each projection's experts stacked in one 3-D tensor; or a tiny
    Qwen2-MoE (arch "qwen2moe"): q/k/v biases instead of the norms, and a shared expert with
    its sigmoid gate (ffn_*_shexp, ffn_gate_inp_shexp, a vector); an OLMoE (q/k norms over
    the whole projection); or a Mixtral, which llama.cpp writes as "llama" with experts (q/k
    rows permuted, no norms)."""
    import torch
    import transformers

    out_path = Path(out_path)
    torch.manual_seed(seed)
    qwen2 = arch == "qwen2moe"
    model_name, config_name, changes = MOE_ARCHS[arch]
    cfg = dict(MOE_CONFIG, **changes)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**cfg))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    type_of = _type_picker(types, MOE_MIXED)
    writer, add = _start_writer(out_path, "llama" if arch == "mixtral" else arch, "tiny-moe", cfg)
    if qwen2:
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_expert_count(cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])

    add("token_embd.weight", state["model.embed_tokens.weight"], type_of("token_embd", None))
    i_size = cfg["moe_intermediate_size"]
    for i in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", state[layer + "input_layernorm.weight"], "F32")
        add(f"blk.{i}.ffn_norm.weight", state[layer + "post_attention_layernorm.weight"], "F32")
        if qwen2:
            for role, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                add(f"blk.{i}.{role}.bias", state[layer + f"self_attn.{hf}.bias"], "F32")
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", state[layer + "mlp.shared_expert_gate.weight"][0], "F32")
            for role, hf in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"),
                             ("ffn_down_shexp", "down_proj")):
                add(f"blk.{i}.{role}.weight", state[layer + f"mlp.shared_expert.{hf}.weight"],
                    type_of("ffn_gate_exps" if role != "ffn_down_shexp" else "ffn_down_exps", i))
        elif arch != "mixtral":
            add(f"blk.{i}.attn_q_norm.weight", state[layer + "self_attn.q_norm.weight"], "F32")
            add(f"blk.{i}.attn_k_norm.weight", state[layer + "self_attn.k_norm.weight"], "F32")
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
        for role, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                         ("attn_output", "o_proj")):
            weight = state[layer + f"self_attn.{hf}.weight"]
            if arch == "mixtral" and hf in heads:  # llama.cpp's rotary layout, as its converter
                weight = _permute_rotary(weight, heads[hf])
            add(f"blk.{i}.{role}.weight", weight, type_of(role, i))
        add(f"blk.{i}.ffn_gate_inp.weight", state[layer + "mlp.gate.weight"], "F32")
        gate_up = state[layer + "mlp.experts.gate_up_proj"]  # [E, 2I, H]
        add(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :i_size], type_of("ffn_gate_exps", i))
        add(f"blk.{i}.ffn_up_exps.weight", gate_up[:, i_size:], type_of("ffn_up_exps", i))
        add(f"blk.{i}.ffn_down_exps.weight", state[layer + "mlp.experts.down_proj"], type_of("ffn_down_exps", i))
    add("output_norm.weight", state["model.norm.weight"], "F32")
    add("output.weight", state["lm_head.weight"], type_of("output", None))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--arch", default="llama", choices=["llama", *MOE_ARCHS])
    parser.add_argument("--types", default="mixed", help="mixed, or one GGUF type for every weight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_gguf(args.out, args.types, args.seed, args.arch))


if __name__ == "__main__":
    main()
