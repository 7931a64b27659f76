"""The decoder layers' native path (csrc/cpu/decoder_layer.cpp: layer specs built by
layers/native.py, each layer one call, and the whole stack of them one call a step) against
the layers' Python path: the same kernels in the same order, so bitwise the same logprobs,
for decode steps and for a prefill long enough to take the BLAS branch of the linear layers;
for the Llama family (per-head q/k norms, sliding windows, layers without rope), Gemma 2 and 3
(local and global layers in two KV groups), the mixtures of experts (dense layers among MoE
ones, a shared expert, q/k normalised over the projection) and K-quant GGUFs."""

import pytest

from pyserve import LLM, SamplingParams
from pyserve.model.layers.linear import PACKED_MAX_ROWS


def _run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
            for o in llm.generate(prompts, params)]


# qwen2: qkv bias; qwen3: per-head q/k norms; smollm3: layers without rope; the MoE ones: their
# experts (qwen2moe: a shared expert, dense layers; olmoe: q/k norms over the projection)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3", "mistral", "mistral-sw", "qwen3", "smollm3",
                                  "qwen3moe", "qwen2moe", "mixtral", "olmoe"])
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


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])  # gemma3: q/k norms; gemma2: softcaps
def test_native_gemma_stack_equals_python_layers(tiny_model_factory, arch):
    llm = LLM(str(tiny_model_factory(arch)), max_num_batched_tokens=512, kv_cache_memory="64MiB")
    runner = llm.engine.executor.runner
    decoder = runner.model.model
    assert llm.engine.kv.num_groups > 1  # the sliding layers' tables are not the global ones'
    # longer than the 8-token windows, and than the packed kernels' rows
    prompts = [list(range(3, 3 + PACKED_MAX_ROWS + 40)), [5, 6, 7], list(range(10, 50))]
    native = _run(llm, prompts)
    assert decoder.native_stack(runner.kv_caches) is not None  # the stack ran
    for layer in decoder.own_layers:
        layer.native = None
    assert _run(llm, prompts) == native
    assert decoder.native_stack(runner.kv_caches) is None


def test_native_stack_takes_a_merged_layer_packed_per_part(tmp_path):
    from make_tiny_gguf import make_tiny_gguf

    llm = LLM(str(make_tiny_gguf(tmp_path / "tiny-mixed.gguf", "mixed")), download_dir=str(tmp_path))
    runner = llm.engine.executor.runner
    layers = runner.model.model.layers
    assert layers[2].self_attn.qkv_proj.packed_parts is not None  # q, k in Q4_K, v in Q6_K
    assert all(layer.native is not None for layer in layers)
    prompts = [list(range(3, 3 + PACKED_MAX_ROWS + 40)), [5, 6, 7]]
    native = _run(llm, prompts)
    assert runner.model.model.native_stack(runner.kv_caches) is not None
    for layer in layers:
        layer.native = None
    assert _run(llm, prompts) == native


@pytest.mark.parametrize("arch", ["granite", "olmo2"])  # residual multipliers; norms after sublayers
def test_layers_the_native_path_cannot_take_stay_in_python(tiny_model_factory, arch):
    llm = LLM(str(tiny_model_factory(arch)))
    decoder = llm.engine.executor.runner.model.model
    assert all(layer.native is None for layer in decoder.layers)
    assert decoder.native_stack(llm.engine.executor.runner.kv_caches) is None


def test_native_stack_reuses_its_step_buffers_bitwise(tiny_model_factory, monkeypatch):
    """Steps of up to LlamaStack's kBufferedRows rows keep their intermediates in buffers
    reused across layers and steps: row counts that change from step to step (chunked
    prefills beside decode rows, then a batch that shrinks as requests end) refit them, and
    every logprob is still bitwise that of each layer's own native call (buffers of its own)
    and of the Python layers."""
    llm = LLM(str(tiny_model_factory("llama")), max_num_batched_tokens=48)
    decoder = llm.engine.executor.runner.model.model
    prompts = [list(range(3, 103)), [5, 6, 7], list(range(10, 40)), [9]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=2, ignore_eos=True)
              for n in (12, 3, 7, 1)]

    def run():
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]

    stacked = run()
    assert decoder.native_stack(llm.engine.executor.runner.kv_caches) is not None
    with monkeypatch.context() as patch:  # each layer's native call, one at a time
        patch.setattr(decoder, "native_stack", lambda kv_caches: None)
        assert run() == stacked
    for layer in decoder.layers:
        layer.native = None
    assert run() == stacked


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_native_stack_runs_a_quantized_moe_gguf_as_its_python_layers(tmp_path, activations):
    """A tiny Qwen3-MoE GGUF (experts in their K-quant blocks, one layer's gate and up in two
    types) through the native stack: bitwise its Python layers, with exact or int8 activations."""
    from make_tiny_gguf import make_tiny_gguf

    path = make_tiny_gguf(tmp_path / "tiny-moe.gguf", "mixed", arch="qwen3moe")
    llm = LLM(str(path), download_dir=str(tmp_path), gguf_activations=activations,
              max_num_batched_tokens=512)
    runner = llm.engine.executor.runner
    decoder = runner.model.model
    assert all(layer.native is not None for layer in decoder.layers)
    prompts = [list(range(3, 3 + PACKED_MAX_ROWS + 40)), [5, 6, 7]]
    native = _run(llm, prompts)
    assert decoder.native_stack(runner.kv_caches) is not None
    for layer in decoder.layers:
        layer.native = None
    assert _run(llm, prompts) == native
