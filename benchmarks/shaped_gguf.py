"""GGUF files in the shapes people run, with random weights, for speed at real sizes:

    python -m benchmarks.shaped_gguf qwen3-30b-a3b OUT.gguf [--layers 8] [--types q4_k_m|q8_0]
    python -m benchmarks.shaped_gguf qwen3-1.7b OUT.gguf
    python -m benchmarks.shaped_gguf llama-3.2-3b OUT.gguf
    python -m benchmarks.shaped_gguf qwen3.5-9b OUT.gguf [--layers 8]

Each preset has the real model's hidden size, heads, expert shapes and vocabulary (--layers
may cut the layer count so that a large model fits this machine). The weights are random
blocks with sane scales (weights of about 0.02), written directly in their GGUF types: the
gguf package quantizes Q8_0 but not the K-quants, and speed does not depend on the values.
q4_k_m places types as llama.cpp's Q4_K_M does: Q6_K for the output and for attn_v and
ffn_down (experts too) on the layers its use_more_bits picks, Q4_K elsewhere (the linear
layers' small beta and alpha projections, their decay and convolution stay float32, as the
converter leaves 1-D and tiny tensors). The tokenizer is
byte-level BPE (the 256 byte tokens, a few hundred merges, fillers up to the vocabulary
size): random prompts tokenize and every server reads it. Pass ignore_eos when serving it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # the dense MLP's intermediate size
    vocab: int
    rope_theta: float
    tied: bool  # no output.weight: the LM head is the embedding
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    qk_norm: bool = False
    # a linear-attention hybrid (qwen35): Gated DeltaNet key heads, value heads, their sizes,
    # every full_attention_interval-th layer full (gated) attention with rope over rotary_dim
    linear_heads: tuple[int, int, int, int] | None = None
    full_attention_interval: int = 4
    rotary_dim: int = 0


PRESETS = {
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, 1e6, False,
                           experts=128, experts_used=8, expert_ffn=768, qk_norm=True),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, 1e6, True, qk_norm=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, 5e5, True),
    # Qwen3.5-9B (transformers' Qwen3_5TextConfig defaults): 16 key and 32 value heads of 128
    "qwen3.5-9b": Shape("qwen35", 4096, 32, 16, 4, 256, 12288, 248320, 1e7, False, qk_norm=True,
                        linear_heads=(16, 32, 128, 128), rotary_dim=64),
}

# bytes per block, weights per block, and how to give a block of random bytes sane scales
BLOCK = {"Q4_K": (144, 256), "Q6_K": (210, 256), "Q8_0": (34, 32)}


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(type_: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / block weights * block bytes] uint8: random quants and integer scales,
    float16 scales chosen so that the weights spread about ±0.02."""
    size, weights = BLOCK[type_]
    n = rows * (cols // weights)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    jitter = rng.uniform(0.8, 1.2, n)
    if type_ == "Q4_K":  # w = d·sc·q - dmin·m, sc and m 6-bit, q 4-bit: centred near zero
        blocks[:, 0:2] = _f16(1.2e-4 * jitter)
        blocks[:, 2:4] = _f16(9e-4 * jitter)
    elif type_ == "Q6_K":  # w = d·scale·(q - 32), scale int8
        blocks[:, 208:210] = _f16(1.5e-5 * jitter)
    else:  # Q8_0: w = d·q, q int8
        blocks[:, 0:2] = _f16(2.7e-4 * jitter)
    return blocks.reshape(rows, -1)


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(types: str, role: str, layer: int | None, layers: int) -> str:
    if types == "q8_0":
        return "Q8_0"
    if role == "output":
        return "Q6_K"
    if role in ("attn_v", "ffn_down", "ffn_down_exps") and _use_more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def _tokenizer(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Byte-level BPE: GPT-2's 256 byte characters, merges of lower-case letter pairs and of
    a space before each letter, then fillers to the vocabulary size, the last one the end of
    text token."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tokens = [chars[b] for b in range(256)]
    space = chars[ord(" ")]
    letters = "abcdefghijklmnopqrstuvwxyz"
    merges = [f"{space} {c}" for c in letters] + [f"{a} {b}" for a in letters for b in letters]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<|filler_{i}|>" for i in range(len(tokens), vocab - 1)] + ["<|endoftext|>"]
    types = [1] * (vocab - 1) + [3]  # normal, and one control token
    return tokens, types, merges


def write(shape: Shape, out: Path, types: str = "q4_k_m", seed: int = 0) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), shape.arch)
    writer.add_name(f"random-{shape.arch}")
    writer.add_context_length(40960)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.linear_heads:
        key_heads, value_heads, key_dim, value_dim = shape.linear_heads
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(key_dim)
        writer.add_ssm_group_count(key_heads)
        writer.add_ssm_time_step_rank(value_heads)
        writer.add_ssm_inner_size(value_heads * value_dim)
        writer.add_full_attention_interval(shape.full_attention_interval)
        writer.add_rope_dimension_count(shape.rotary_dim)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    tokens, token_types, merges = _tokenizer(shape.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if shape.arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(shape.vocab - 1)
    writer.add_add_bos_token(False)

    # (name, rows, cols, type or None for float32 ones, experts or 0)
    tensors: list[tuple[str, int, int, str | None, int]] = []

    def weight(name, rows, cols, role, layer=None, experts=0):
        tensors.append((name, rows, cols, tensor_type(types, role, layer, shape.layers), experts))

    weight("token_embd.weight", shape.vocab, shape.hidden, "token_embd")
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        tensors.append((f"blk.{i}.attn_norm.weight", 1, shape.hidden, None, 0))
        tensors.append((f"blk.{i}.{'post_attention_norm' if shape.linear_heads else 'ffn_norm'}.weight",
                        1, shape.hidden, None, 0))
        if shape.linear_heads and (i + 1) % shape.full_attention_interval:
            key_heads, value_heads, key_dim, value_dim = shape.linear_heads
            channels = 2 * key_heads * key_dim + value_heads * value_dim
            weight(f"blk.{i}.attn_qkv.weight", channels, shape.hidden, "attn_qkv", i)
            weight(f"blk.{i}.attn_gate.weight", value_heads * value_dim, shape.hidden, "attn_gate", i)
            for name in ("ssm_beta", "ssm_alpha"):
                tensors.append((f"blk.{i}.{name}.weight", value_heads, shape.hidden, None, 0))
            tensors.append((f"blk.{i}.ssm_a", 1, value_heads, None, 0))
            tensors.append((f"blk.{i}.ssm_dt.bias", 1, value_heads, None, 0))
            tensors.append((f"blk.{i}.ssm_conv1d.weight", channels, 4, None, 0))
            tensors.append((f"blk.{i}.ssm_norm.weight", 1, value_dim, None, 0))
            weight(f"blk.{i}.ssm_out.weight", shape.hidden, value_heads * value_dim, "ssm_out", i)
            weight(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden, "ffn_gate", i)
            weight(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden, "ffn_up", i)
            weight(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn, "ffn_down", i)
            continue
        if shape.linear_heads:  # gated attention: q_proj yields each head's query and gate
            q = 2 * shape.heads * shape.head_dim
        if shape.qk_norm:
            tensors.append((f"blk.{i}.attn_q_norm.weight", 1, shape.head_dim, None, 0))
            tensors.append((f"blk.{i}.attn_k_norm.weight", 1, shape.head_dim, None, 0))
        weight(f"blk.{i}.attn_q.weight", q, shape.hidden, "attn_q", i)
        weight(f"blk.{i}.attn_k.weight", kv, shape.hidden, "attn_k", i)
        weight(f"blk.{i}.attn_v.weight", kv, shape.hidden, "attn_v", i)
        weight(f"blk.{i}.attn_output.weight", shape.hidden, shape.heads * shape.head_dim, "attn_output", i)
        if shape.experts:
            tensors.append((f"blk.{i}.ffn_gate_inp.weight", shape.experts, shape.hidden, None, 0))
            for part, rows, cols in (("gate", shape.expert_ffn, shape.hidden),
                                     ("up", shape.expert_ffn, shape.hidden),
                                     ("down", shape.hidden, shape.expert_ffn)):
                weight(f"blk.{i}.ffn_{part}_exps.weight", rows, cols, f"ffn_{part}_exps", i, shape.experts)
        else:
            weight(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden, "ffn_gate", i)
            weight(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden, "ffn_up", i)
            weight(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn, "ffn_down", i)
    tensors.append(("output_norm.weight", 1, shape.hidden, None, 0))
    if not shape.tied:
        weight("output.weight", shape.vocab, shape.hidden, "output")

    def byte_shape(rows, cols, type_, experts):
        lead = (experts,) if experts else ()
        if type_ is None:
            return lead + ((cols,) if rows == 1 else (rows, cols))
        size, per = BLOCK[type_]
        return lead + (rows, cols // per * size)

    for name, rows, cols, type_, experts in tensors:
        shape_bytes = byte_shape(rows, cols, type_, experts)
        nbytes = int(np.prod(shape_bytes)) * (4 if type_ is None else 1)
        writer.add_tensor_info(name, shape_bytes, np.dtype(np.float32 if type_ is None else np.uint8), nbytes,
                               raw_dtype=None if type_ is None else gguf.GGMLQuantizationType[type_])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, rows, cols, type_, experts in tensors:
        if type_ is None and name.endswith("ssm_a"):  # A = -exp(A_log): decays of about 0.5 a token
            data = -rng.uniform(0.5, 1.5, cols).astype(np.float32)
        elif type_ is None:  # norms (ones), routers and the rest (small random values)
            data = (np.ones(cols, np.float32) if rows == 1
                    else rng.normal(0, 0.02, (rows, cols)).astype(np.float32))
        elif experts:
            data = np.stack([random_blocks(type_, rows, cols, rng) for _ in range(experts)])
        else:
            data = random_blocks(type_, rows, cols, rng)
        writer.write_tensor_data(data)
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shaped_gguf", description=__doc__.splitlines()[0])
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the real model's")
    p.add_argument("--types", default="q4_k_m", choices=["q4_k_m", "q8_0"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = PRESETS[args.preset]
    if args.layers is not None:
        from dataclasses import replace

        shape = replace(shape, layers=args.layers)
    path = write(shape, args.out, args.types, args.seed)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
