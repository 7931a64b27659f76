"""Which Hugging Face architectures pyserve runs, and with which model class."""

from __future__ import annotations

from pyserve.errors import ModelLoadError

# One decoder implementation covers these; ModelArch carries their differences
# (qkv bias for Qwen2, q/k norm for Qwen3, rope scaling for Llama 3).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def model_class(architecture: str):
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{architecture}'; pyserve supports: "
            + ", ".join(SUPPORTED_ARCHITECTURES))
    from pyserve.model.models.llama import LlamaForCausalLM

    return LlamaForCausalLM
