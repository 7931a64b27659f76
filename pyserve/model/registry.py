"""Which Hugging Face architectures pyserve runs, and with which model class."""

from __future__ import annotations

from pyserve.errors import ModelLoadError

# One decoder implementation covers these; ModelArch carries their differences
# (qkv bias for Qwen2, q/k norm for Qwen3, rope scaling for Llama 3).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",  # Mistral with sliding windows by layer_types
    "SeedOssForCausalLM",  # ByteDance Seed-OSS: Llama with q/k/v biases
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# models/gemma.py: Gemma 2 and 3 (a multimodal Gemma 3 checkpoint's text model only)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# models/moe.py: mixtures of experts on the Llama decoder
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
                     "OlmoeForCausalLM")
# the Llama decoder with a family's own difference, each in models/<family>.py
FAMILY_ARCHITECTURES = {"SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
                        "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
                        "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
                        "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
                        "Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLM"),
                        "Exaone4ForCausalLM": ("exaone4", "Exaone4ForCausalLM"),
                        "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
                        "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
                        "HunYuanDenseV1ForCausalLM": ("hunyuan", "HunYuanDenseV1ForCausalLM"),
                        **{name: ("qwen3_next", "HybridForCausalLM") for name in (
                            "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                            "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")}}
# linear-attention hybrids (models/qwen3_next.py): a state pool beside the KV cache
HYBRID_ARCHITECTURES = tuple(name for name, (module, _) in FAMILY_ARCHITECTURES.items()
                             if module == "qwen3_next")
# Encoders, for embeddings only (models/bert.py; models/encoder.py adapts them to the runner)
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel",
                         # masked-LM checkpoints: the same encoder, their head unread
                         "BertForMaskedLM", "RobertaForMaskedLM", "XLMRobertaForMaskedLM")


def is_encoder(architecture: str) -> bool:
    return architecture in ENCODER_ARCHITECTURES


def model_class(architecture: str):
    if is_encoder(architecture):
        from pyserve.model.models.encoder import EncoderForEmbedding

        return EncoderForEmbedding
    if architecture in GEMMA_ARCHITECTURES:
        from pyserve.model.models.gemma import GemmaForCausalLM

        return GemmaForCausalLM
    if architecture in FAMILY_ARCHITECTURES:
        import importlib

        module, name = FAMILY_ARCHITECTURES[architecture]
        return getattr(importlib.import_module(f"pyserve.model.models.{module}"), name)
    if architecture in MOE_ARCHITECTURES:
        from pyserve.model.models.moe import MoeForCausalLM

        return MoeForCausalLM
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{architecture}'; pyserve supports: "
            + ", ".join(SUPPORTED_ARCHITECTURES + GEMMA_ARCHITECTURES + tuple(FAMILY_ARCHITECTURES)
                        + MOE_ARCHITECTURES + ENCODER_ARCHITECTURES))
    from pyserve.model.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
