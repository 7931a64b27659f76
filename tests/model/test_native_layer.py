"""The decoder layers' native path (csrc/cpu/decoder_layer.cpp: each layer one call, and the
whole stack of them one call a step) against the layers' Python path: the same kernels in the
same order, so bitwise the same logprobs, for decode steps and for a prefill long enough to
take the BLAS branch of the linear layers."""

import pytest

from pyserve import LLM, SamplingParams
from pyserve.model.layers.linear import PACKED_MAX_ROWS


def _run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
            for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "mistral"])  # qwen2: qkv bias
def test_native_layer_equals_python_layer(tiny_model_factory, arch):
    llm = LLM(str(tiny_model_factory(arch)), max_num_batched_tokens=512)
    layers = llm.engine.executor.runner.model.model.layers
    assert all(layer.native is not None for layer in layers)
    prompts = [list(range(3, 3 + PACKED_MAX_ROWS + 40)), [5, 6, 7], list(range(10, 50))]
    native = _run(llm, prompts)
    decoder = llm.engine.executor.runner.model.model
    assert decoder.native_stack(llm.engine.executor.runner.kv_caches) is not None  # the stack ran
    for layer in layers:
        layer.native = None
    assert _run(llm, prompts) == native
    assert decoder.native_stack(llm.engine.executor.runner.kv_caches) is None


def test_layers_the_native_path_cannot_take_stay_in_python(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("qwen3")))  # q/k norm
    assert all(layer.native is None for layer in llm.engine.executor.runner.model.model.layers)
