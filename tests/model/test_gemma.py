"""Gemma 3 and Gemma 2 (tools/make_tiny_model.py: sliding windows of 8 tokens between global
layers, Gemma 2 softcapped) against transformers in float32: greedy ids identical for prompts
longer than the window and generation far beyond it, prompts split into chunks across steps,
and prefix-cache hits that start a step's chunk inside a cached window."""

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.executor.plan import resolve_max_model_len
from pyserve.model.arch import ModelArch
from pyserve.model.layers.norm import GemmaRMSNorm

from .reference import hf_greedy, load_hf

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values",
    "Paris",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Tokyo is the capital of Japan. Python, C++",
]
# the long prompts again, extended: their first blocks come from the prefix cache
EXTENDED = [PROMPTS[1] + " in fixed-size blocks.", PROMPTS[3] + " and CUDA. Hello, world!"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _check(llm, hf, prompts):
    outputs = llm.generate(prompts, GREEDY)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 40)
    return outputs


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_greedy_matches_transformers(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    llm = LLM(str(path), kv_cache_memory="64MiB", max_num_batched_tokens=24,
              enable_prefix_caching=True)
    hf = load_hf(path)
    # each norm's 1 + weight is computed once, from the loaded (nonzero) weight
    norms = [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, GemmaRMSNorm)]
    assert norms and all(torch.equal(m.frozen_scale, 1.0 + m.weight.float()) for m in norms)
    assert all(m.weight.abs().sum() > 0 for m in norms)
    first = _check(llm, hf, PROMPTS)
    assert max(len(o.prompt_token_ids) for o in first) > 24 > 8  # chunked, and past the window
    again = _check(llm, hf, EXTENDED)
    assert all(o.num_cached_tokens >= 16 for o in again)


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tiny_model_factory):
    from transformers import Gemma3ForConditionalGeneration

    path = tiny_model_factory("gemma3-mm")
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(str(path), kv_cache_memory="64MiB", max_num_batched_tokens=24)
    _check(llm, hf, PROMPTS[1:2])


def test_gemma2_logprobs_are_of_the_softcapped_logits(tiny_model_factory):
    """Softcapping is monotone, so greedy ids cannot see it: the logprobs do."""
    path = tiny_model_factory("gemma2")
    llm = LLM(str(path), kv_cache_memory="64MiB")
    out = llm.generate(PROMPTS[1:2], SamplingParams(temperature=0.0, max_tokens=12, logprobs=0,
                                                     ignore_eos=True))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = load_hf(path)(torch.tensor([ids])).logits[0]
    expected = logits.log_softmax(-1)[len(out.prompt_token_ids) - 1:-1]
    got = [position[token].logprob for position, token in zip(out.outputs[0].logprobs,
                                                              out.outputs[0].token_ids)]
    want = [expected[i, token].item() for i, token in enumerate(out.outputs[0].token_ids)]
    assert got == pytest.approx(want, abs=1e-4)


def test_multimodal_text_config_takes_gemma3_defaults_and_every_sixth_layer_global():
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024, "model_type": "gemma3_text"}}
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size) == (8, 4, 256, 262_208)
    assert arch.query_pre_attn_scalar == 256 and arch.tie_word_embeddings
    assert (arch.rope_theta, arch.rope_local_theta) == (1e6, 1e4)
    assert arch.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert arch.eos_token_ids == (1, 106) and arch.hidden_activation == "gelu_pytorch_tanh"
    windows = [arch.layer_window(i) for i in range(12)]
    assert windows == [1024] * 5 + [None] + [1024] * 5 + [None]


def test_rope_parameters_per_layer_type_and_no_length_cap():
    cfg = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "max_position_embeddings": 4096, "sliding_window": 16,
           "layer_types": ["sliding_attention", "full_attention"],
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}}
    arch = ModelArch.from_hf_config(cfg)
    assert (arch.rope_theta, arch.rope_local_theta, arch.rope_scaling) == (5e5, 1e3, None)
    assert [arch.layer_window(0), arch.layer_window(1)] == [16, None]
    assert resolve_max_model_len(None, arch) == 4096  # windows no longer cap the length
    mistral = ModelArch.from_hf_config({**cfg, "architectures": ["MistralForCausalLM"],
                                        "layer_types": None, "rope_parameters": None})
    assert [mistral.layer_window(0), mistral.layer_window(1)] == [16, 16]


def _drive_holding(core, prompts, max_tokens):
    """Greedy outputs and the most KV bytes the engine held at once, stepping it directly."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens, peak = {}, 0
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        peak = max(peak, core.kv.num_blocks - core.kv.num_free_blocks)
    assert core.kv.num_free_blocks == core.kv.num_blocks and core.kv.num_tracked_requests() == 0
    return [tokens[f"r{i}"] for i in range(len(prompts))], peak * core.plan.bytes_per_block


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "mistral-sw"])
def test_hybrid_layout_frees_out_of_window_blocks_and_changes_no_output(tiny_model_factory, arch):
    """Generation far past the 8-token windows: the sliding layers' blocks that fall out go
    back to the pool (kv/groups.py), and every token is what one table per layer gives, and
    what transformers gives."""
    from pyserve.config import Config
    from pyserve.engine.core import EngineCore

    path = tiny_model_factory(arch)
    hf = load_hf(path)
    results = {}
    for disabled in (False, True):
        core = EngineCore(Config.from_flat(model=str(path), kv_cache_memory=1 << 24,
                                           max_num_batched_tokens=24, max_model_len=512,
                                           disable_hybrid_kv_cache_manager=disabled))
        assert (core.kv.num_groups > 1 or core.kv.groups.frees_windows) != disabled
        prompts = [core.tokenizer.encode(p) for p in PROMPTS[1:4]]
        results[disabled] = _drive_holding(core, prompts, 120)
        core.shutdown()
    (hybrid, hybrid_bytes), (plain, plain_bytes) = results[False], results[True]
    assert hybrid == plain
    assert hybrid[0] == hf_greedy(hf, prompts[0], 120)
    assert hybrid_bytes < 0.75 * plain_bytes  # long past the window, sliding layers hold little


def test_hybrid_layout_at_tensor_parallel_size_2_equals_size_1(tiny_model_factory):
    """The step channel carries every KV group's tables to the other rank."""
    path = str(tiny_model_factory("gemma2"))
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory="16MiB", max_num_batched_tokens=24,
                  max_model_len=256)
        try:
            assert llm.engine.kv.num_groups == 2
            results[tp] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        finally:
            llm.shutdown()
    assert results[1] == results[2]
