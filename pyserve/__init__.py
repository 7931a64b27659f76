"""pyserve: an LLM inference server in the class of vLLM."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):  # keep `python -m pyserve --help` fast: import torch only when needed
    if name == "LLM":
        from pyserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pyserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "RequestOutput":
        from pyserve.engine.output import RequestOutput

        return RequestOutput
    raise AttributeError(name)
