"""Makes a tiny random model directory of a supported architecture, for tests and examples:
config.json + safetensors (optionally sharded) written by transformers from a config, and a
small byte-level BPE tokenizer trained on a built-in text.

    python tools/make_tiny_model.py OUT_DIR --arch qwen3 [--shard]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB_SIZE = 512
_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

_LINEAR = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4)

# name -> (transformers config class name, overrides)
ARCHES = {
    "llama": ("LlamaConfig", {}),
    # head_dim 64, a head size the CUDA attention kernel has (64, 128, 256); the others have 16 or 32
    "llama-hd64": ("LlamaConfig", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)),
    "llama-tied-mha": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(
        num_attention_heads=8, num_key_value_heads=1, hidden_size=128, max_position_embeddings=1024,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0,
                                               original_max_position_embeddings=64))),
    # YaRN over an original length of 64 (every test prompt reaches past the interpolated band)
    "qwen3-yarn": ("Qwen3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # NoPE every second layer (SmolLM3 drops rope every fourth); tied as SmolLM3-3B
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                      tie_word_embeddings=True)),
    # q/k/v and gate/up each one tensor in the checkpoint
    "phi3": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                pad_token_id=0)),
    # multipliers far from 1, so that each one shows (Granite 3's are 12, 1/128, 0.22, 8)
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, attention_multiplier=0.05,
                                      residual_multiplier=0.3, logits_scaling=4.0,
                                      tie_word_embeddings=True)),
    # norms after attention and MLP; q/k norms over the whole projection
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=3)),
    # OLMo 2's layers, windows of 8 on three layers of four, YaRN on the full layers only
    "olmo3": ("Olmo3Config", dict(
        num_hidden_layers=4, sliding_window=8, max_position_embeddings=1024,
        rope_parameters={"full_attention": dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                original_max_position_embeddings=64),
                         "sliding_attention": dict(rope_type="default", rope_theta=500.0)})),
    # windows of 8 on every other layer
    "ministral": ("MinistralConfig", dict(num_hidden_layers=4, head_dim=16, sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"] * 2)),
    # q/k/v biases by default (attention_bias left out of the config)
    "seed_oss": ("SeedOssConfig", dict(head_dim=16)),
    # post-norms, per-head q/k norms, windows of 8 on three layers of four, no rope on the fourth
    "exaone4": ("Exaone4Config", dict(num_hidden_layers=4, head_dim=16, sliding_window=8,
                                      sliding_window_pattern=4)),
    # four norms a layer, rope over half of each head in interleaved pairs, q/k/v biases
    "glm4": ("Glm4Config", dict(head_dim=16, partial_rotary_factor=0.5)),
    # rope in interleaved pairs over whole heads; tied
    "ernie4_5": ("Ernie4_5Config", dict(head_dim=16, tie_word_embeddings=True)),
    # q/k norms after the rope, whose base NTK-alpha stretches (the checkpoints' "dynamic")
    "hunyuan": ("HunYuanDenseV1Config", dict(
        head_dim=16, rope_scaling=dict(type="dynamic", alpha=1000.0, factor=1.0))),
    "mistral": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                                      head_dim=16, sliding_window=None)),
    # every layer windowed, 8 tokens: shorter than the test prompts
    "mistral-sw": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # mixtures of experts: 8 experts of 32, top 2 (Qwen3-MoE: renormalised, its second layer
    # dense; Qwen2-MoE: not renormalised, a gated shared expert; Mixtral: every layer sparse;
    # OLMoE: q/k norms over the whole projection)
    "qwen3moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2moe": ("Qwen2MoeConfig", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                      sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                  norm_topk_prob=False)),
    # linear-attention hybrids: three Gated DeltaNet layers, then gated full attention; two
    # value heads per key head; Qwen3-Next with a dense layer among its MoE layers
    "qwen3_5": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, **_LINEAR)),
    "qwen3_5moe": ("Qwen3_5MoeTextConfig", dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, **_LINEAR)),
    "qwen3next": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True, **_LINEAR)),
    # every layer MoE: what llama.cpp's converter takes of Qwen3-Next
    "qwen3next-moe": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, **_LINEAR)),
    # sliding windows of 8 tokens (shorter than the test prompts, so local layers really slide)
    # between global layers; head_dim 64 apart from hidden / heads; an attention scale of its own
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=48, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
        tie_word_embeddings=True)),
    # softcapping tight enough to bend random scores and logits; every other layer local
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=8,
        attn_logit_softcapping=10.0, final_logit_softcapping=8.0, tie_word_embeddings=True)),
    # Gemma 3 270M's attention shapes (18 layers, every sixth global, 1 KV head of 256, windows
    # of 512, 32k positions) on a tiny hidden size: its KV cache at a fraction of the compute
    "gemma3-270m-kv": ("Gemma3TextConfig", dict(
        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)},
        tie_word_embeddings=True)),
    # the multimodal checkpoint layout (text config nested, weights under language_model), with
    # a one-layer vision tower that pyserve does not serve
    "gemma3-mm": ("Gemma3Config", {}),
}

_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values
in fixed-size blocks. Continuous batching lets requests join and leave at any step.
Hello, world! How are you today? I am fine, thank you. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.
Paris is the capital of France. Tokyo is the capital of Japan. Python, C++ and CUDA.
"""


def make_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                          "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
    fast.save_pretrained(str(out))


def make_tiny_model(out_dir: str | Path, arch: str = "llama", shard: bool = False,
                    seed: int = 0, num_layers: int | None = None,
                    tokenizer_from: str | Path | None = None) -> Path:
    """num_layers: num_hidden_layers instead of the architecture's own (not for gemma3-mm).
    tokenizer_from: a model directory whose tokenizer (and vocabulary size) the model takes
    instead of the tiny one: a tokenizer llama.cpp's converter knows (it refuses unknown
    BPE pre-tokenizers)."""
    import torch
    import transformers

    out = Path(out_dir)
    config_cls, overrides = ARCHES[arch]
    if tokenizer_from is not None:
        vocab = transformers.AutoTokenizer.from_pretrained(str(tokenizer_from))
        overrides = {**overrides, "vocab_size": len(vocab), "bos_token_id": vocab.bos_token_id,
                     "eos_token_id": vocab.eos_token_id, "pad_token_id": vocab.pad_token_id}
    if num_layers is not None:
        overrides = {**overrides, "num_hidden_layers": num_layers}
        if "layer_types" in overrides:  # Gemma 3's pattern, repeated to the new length
            pattern = overrides["layer_types"]
            overrides["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    torch.manual_seed(seed)
    if config_cls == "Gemma3Config":
        text = transformers.Gemma3TextConfig(**{**_BASE, **ARCHES["gemma3"][1]})
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(
            text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
            image_token_index=VOCAB_SIZE - 3, boi_token_index=VOCAB_SIZE - 2,
            eoi_token_index=VOCAB_SIZE - 1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32)
    else:
        config = getattr(transformers, config_cls)(**{**_BASE, **overrides})
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch.startswith(("gemma", "qwen3_5", "qwen3next")):
        # Gemma's norms start at (1 + 0): with the sqrt(hidden)-scaled embedding tied to the head,
        # the last token's own embedding would outweigh the layers, and the model repeat it
        # (the hybrids' zero-centred norms likewise start at one: random, so that each shows)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 1.0)
    model.save_pretrained(str(out), max_shard_size="100KB" if shard else "2GB")
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_from is None:
        make_tokenizer(out)
    else:
        vocab.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=sorted(ARCHES), default="llama")
    parser.add_argument("--shard", action="store_true", help="write a sharded checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_tiny_model(args.out_dir, args.arch, args.shard, args.seed))


if __name__ == "__main__":
    main()
