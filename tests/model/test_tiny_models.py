"""Every supported architecture, as a tiny random model made by tools/make_tiny_model.py,
against transformers: greedy ids identical for a batch of prompts of different lengths, with
prompts split into chunks across steps."""

import pytest

from pyserve import LLM, SamplingParams

from .reference import hf_greedy, load_hf

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values",
    "Paris",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Tokyo is the capital of Japan. Python, C++",
]


@pytest.mark.parametrize("arch,shard", [
    ("llama", False), ("llama", True), ("llama-tied-mha", False), ("llama3", False),
    ("mistral", False), ("mistral-sw", False), ("qwen2", False), ("qwen3", False),
    ("qwen3-yarn", False), ("smollm3", False), ("phi3", True), ("granite", False),
    ("olmo2", False), ("olmo3", False), ("ministral", False),
    ("seed_oss", False), ("exaone4", False), ("glm4", False), ("ernie4_5", False),
    ("hunyuan", False),
    ("qwen3moe", False), ("qwen2moe", False), ("mixtral", True), ("olmoe", False),
    ("qwen3_5", False), ("qwen3_5moe", True), ("qwen3next", False),
])
def test_greedy_matches_transformers(tiny_model_factory, arch, shard):
    path = tiny_model_factory(arch, shard)
    if shard:
        assert (path / "model.safetensors.index.json").exists()
    llm = LLM(str(path), kv_cache_memory="64MiB", max_num_batched_tokens=24)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    hf = load_hf(path)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 40)
        assert out.outputs[0].finish_reason == "length"
