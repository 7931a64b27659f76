"""A mixture of experts from a GGUF file, read in place (model/gguf.py) and run by the fused
native path (csrc/cpu/moe.cpp): a tiny Qwen3-MoE laid out as llama.cpp lays it out (stacked
ffn_*_exps tensors in Q4_K_M's types, a layer whose gate and up differ in type, Q8_0 and Q5_0
experts) keeps every expert in its blocks and computes bitwise what the float32 checkpoint of
its dequantized weights computes, whose greedy ids equal transformers'; with int8 activations
it stays close; served over a socket it answers as offline. Issue 56."""

import json

import pytest
import torch

from pyserve import LLM, SamplingParams

from .reference import hf_greedy, load_hf

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog " * 6]
NEW = 16


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    from make_tiny_gguf import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("moe-gguf") / "tiny-moe.gguf", "mixed", arch="qwen3moe")


@pytest.fixture(scope="module")
def float32_dir(moe_gguf, tmp_path_factory):
    from pyserve.model.gguf import convert_gguf

    return convert_gguf(moe_gguf, tmp_path_factory.mktemp("moe-float32") / "model")


def test_config_and_experts_read_from_the_file(moe_gguf, float32_dir, tmp_path):
    cfg = json.loads((float32_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 2, 256)
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == []
    llm = LLM(str(moe_gguf), download_dir=str(tmp_path))
    layers = llm.engine.executor.runner.model.model.layers
    for i, gate_up_stacks in enumerate([1, 2, 1]):  # layer 1: gate Q5_K, up Q4_K apart
        mlp = layers[i].mlp
        assert len(mlp.packed_gate_up) == gate_up_stacks
        assert all(s.dtype == torch.uint8 and s.shape[0] == 8 for s in mlp.packed_gate_up)
        assert mlp.packed_down.dtype == torch.uint8
        assert mlp.experts.gate_up_proj.numel() == 0 and mlp.experts.down_proj.numel() == 0
    # the metadata directory made for the file holds no weights
    (made,) = tmp_path.glob("converted/*")
    assert not any(made.glob("*.safetensors"))


def test_quantized_in_place_equals_its_float32_checkpoint_and_transformers(moe_gguf, float32_dir, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    ours = LLM(str(moe_gguf), download_dir=str(tmp_path)).generate(PROMPTS, params)
    reference = LLM(str(float32_dir)).generate(PROMPTS, params)
    hf = load_hf(float32_dir)
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bitwise: same kernels, same sums
        assert a.prompt_logprobs == b.prompt_logprobs
        assert a.outputs[0].token_ids == hf_greedy(hf, a.prompt_token_ids, NEW)


def test_int8_activations_stay_close(moe_gguf, tmp_path):
    """int8 activations (llama.cpp's arithmetic) move the logits a little: a tiny random
    model's near-ties may flip, so the check is on the distributions: the exact run's next
    token among int8's three likeliest, prompt logprobs within half a nat on average."""
    from pyserve import _native

    if not _native.int8_dot_supported():
        pytest.skip("this build has no int8 dot-product kernel")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, prompt_logprobs=1, ignore_eos=True)
    exact = LLM(str(moe_gguf), download_dir=str(tmp_path)).generate(PROMPTS, params)
    fast_llm = LLM(str(moe_gguf), download_dir=str(tmp_path), gguf_activations="int8")
    assert fast_llm.engine.executor.runner.model.model.layers[0].mlp.packed_down.dtype == torch.int8
    fast = fast_llm.generate(PROMPTS, params)
    for a, b in zip(exact, fast):
        assert a.outputs[0].token_ids[0] in b.outputs[0].logprobs[0]
        diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in
                 zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], a.prompt_token_ids[1:])]
        assert sum(diffs) / len(diffs) < 0.5


def test_served_over_a_socket_equals_offline(moe_gguf, tmp_path):
    import openai

    from tests.e2e.server import ServerProcess

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    offline = LLM(str(moe_gguf), download_dir=str(tmp_path)).generate(PROMPTS, params)
    srv = ServerProcess("--served-model-name", "moe", "--download-dir", str(tmp_path),
                        command=("serve", str(moe_gguf)))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for out in offline:
            got = client.completions.create(model="moe", prompt=out.prompt, max_tokens=NEW, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert got.choices[0].token_ids == out.outputs[0].token_ids
        assert "8 experts, top-2" in srv.output() and "GGUF tensors kept quantized" in srv.output()
    finally:
        assert srv.stop() == 0


def test_tensor_parallel_equals_one_rank(moe_gguf):
    """Two ranks each take their rows of every expert's gate and up blocks; down's inputs
    (128 a rank) do not split on whole 256-weight K-quant blocks, so they are widened to
    float32, as a dense row-parallel layer's would be: the same greedy ids and logprobs."""
    from tests.executor.ranks import assert_split_equals_one_rank

    assert_split_equals_one_rank(moe_gguf, PROMPTS, tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe", "mixtral"])
def test_other_moe_architectures(arch, tmp_path):
    """llama.cpp's qwen2moe (q/k/v biases, a shared expert whose gate it keeps as a vector,
    top-k not renormalised), olmoe (q/k norms over the whole projection, not renormalised)
    and Mixtral's llama with experts (q/k rows permuted, renormalised): each served in place
    bitwise as its float32 conversion, with transformers' greedy ids."""
    from make_tiny_gguf import make_tiny_gguf

    from pyserve.model.gguf import convert_gguf

    path = make_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", "mixed", arch=arch)
    float32 = convert_gguf(path, tmp_path / "float32")
    cfg = json.loads((float32 / "config.json").read_text())
    expected = {"qwen2moe": ("Qwen2MoeForCausalLM", False), "olmoe": ("OlmoeForCausalLM", False),
                "mixtral": ("MixtralForCausalLM", True)}[arch]
    assert (cfg["architectures"][0], cfg["norm_topk_prob"]) == expected
    if arch == "qwen2moe":
        assert cfg["shared_expert_intermediate_size"] == 256 and cfg["attention_bias"] is True
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=2, ignore_eos=True)
    llm = LLM(str(path), download_dir=str(tmp_path / "dl"))
    assert llm.engine.executor.runner.model.model.layers[0].mlp.packed_down.dtype == torch.uint8
    ours = llm.generate(PROMPTS, params)
    reference = LLM(str(float32)).generate(PROMPTS, params)
    hf = load_hf(float32)
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.outputs[0].token_ids == hf_greedy(hf, a.prompt_token_ids, NEW)
