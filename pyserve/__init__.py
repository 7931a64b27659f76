"""pyserve: an LLM inference server in the class of vLLM."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "BeamSearchParams", "PoolingParams",
           "StructuredOutputsParams", "RequestOutputKind", "TextPrompt", "TokensPrompt"]

# what `from vllm import X` users import, by module; loaded on first use so that
# `python -m pyserve --help` stays fast (no torch)
_EXPORTS = {"LLM": "pyserve.llm", "SamplingParams": "pyserve.sampling_params",
            "BeamSearchParams": "pyserve.sampling_params",
            "StructuredOutputsParams": "pyserve.sampling_params",
            "RequestOutputKind": "pyserve.sampling_params", "RequestOutput": "pyserve.engine.output",
            "PoolingParams": "pyserve.pooling_params", "TextPrompt": "pyserve.inputs",
            "TokensPrompt": "pyserve.inputs"}


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
