"""A K-quant GGUF (tools/make_tiny_gguf.py: a tiny random Llama, its weights in Q4_0, Q4_K, Q5_K
and Q6_K, a few in types pyserve widens) served by the offline LLM with its blocks kept
quantized: greedy output token for token that of transformers loading the same file; Q5_0,
which transformers does not load, bitwise the converted float32 checkpoint's."""

import logging
import math

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams, _native

from .reference import hf_greedy, load_hf

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Hello, world! How are you"]
# the packed group size of each type (csrc/cpu/linear_kquant.h), which names a packed weight's format
GROUP_BYTES = {"Q4_0": 576, "Q5_0": 704, "Q4_K": 4736, "Q5_K": 5760, "Q6_K": 6720, "Q4_1": 640, "Q8_0": 1088}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    from make_tiny_gguf import make_tiny_gguf

    return make_tiny_gguf(tmp_path_factory.mktemp("kquant") / "tiny-mixed.gguf", "mixed")


def _packed_type(packed) -> str:
    if packed.dtype != torch.uint8:
        return str(packed.dtype)
    return next(t for t, size in GROUP_BYTES.items() if size == packed.shape[2])


def _type_of(layer) -> str:
    """The packed weight's type; a merged layer packed per part: its parts' types, joined."""
    if layer.packed is None and getattr(layer, "packed_parts", None) is not None:
        return "+".join(_packed_type(p) for p, _ in layer.packed_parts)
    return _packed_type(layer.packed)


@pytest.mark.parametrize("kind,bound", [("Q4_K", 0.1), ("Q5_K", 0.05), ("Q6_K", 0.03)])
def test_tool_encoders_are_valid_k_quants(kind, bound):
    """The tool's own K-quant encoders (gguf only dequantizes these types) give blocks of the
    type's size that gguf dequantizes to within the type's step of the weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from make_tiny_gguf import encode

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((6, 512)) * 0.2).astype(np.float32)
    weight[0, :256] = 0.0  # an all-zero super-block: zero scales
    weight[1] += 3.0  # no negative weight: a zero min
    blocks = encode(weight, kind)
    assert blocks.dtype == np.uint8 and blocks.shape == (6, 2 * {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind])
    back = dequantize(blocks, GGMLQuantizationType[kind]).reshape(weight.shape)
    assert np.all(back[0, :256] == 0)
    error = np.abs(back - weight).max(axis=1) / np.abs(weight).max(axis=1)
    assert error.max() < bound, error


def test_k_quant_gguf_is_served_quantized_as_transformers_computes_it(mixed_gguf, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pyserve")
    llm = LLM(str(mixed_gguf), download_dir=str(tmp_path))
    model = llm.engine.executor.runner.model
    layers = model.model.layers
    assert [_type_of(layers[0].self_attn.qkv_proj), _type_of(layers[0].self_attn.o_proj),
            _type_of(layers[0].mlp.gate_up_proj), _type_of(layers[0].mlp.down_proj)] == ["Q4_K", "Q5_K", "Q4_0", "Q6_K"]
    assert [_type_of(layers[1].self_attn.qkv_proj), _type_of(layers[1].self_attn.o_proj),
            _type_of(layers[1].mlp.gate_up_proj), _type_of(layers[1].mlp.down_proj)] == ["Q6_K", "Q4_0", "Q5_K", "Q4_K"]
    # q, k in Q4_K and v in Q6_K share one parameter: each part packed in its own type (and
    # computed by its own kernel); F16 is widened; Q4_1 and Q8_0 kept
    assert [_type_of(layers[2].self_attn.qkv_proj), _type_of(layers[2].self_attn.o_proj),
            _type_of(layers[2].mlp.gate_up_proj), _type_of(layers[2].mlp.down_proj)] == [
        "Q4_K+Q4_K+Q6_K", "torch.float32", "Q8_0", "Q4_1"]
    assert _type_of(model.model.embed_tokens) == "Q4_K" and _type_of(model.lm_head) == "Q6_K"
    assert layers[0].mlp.gate_up_proj.weight.numel() == 0  # no float copy kept
    assert ("GGUF tensors kept quantized: Q4_0 3, Q4_1 1, Q4_K 7, Q5_K 3, Q6_K 6, Q8_0 2; "
            "loaded as float32: F16 1, F32 7") in caplog.text

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    hf = load_hf(mixed_gguf.parent, gguf_file=mixed_gguf.name)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 24), out.prompt


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
def test_int8_activations_reach_every_kept_type(mixed_gguf):
    """--gguf-activations int8 on the mixed file: every layer kept quantized (Q4_0, Q4_K, Q5_K,
    Q6_K, the Q6_K LM head and the Q4_K embedding too) is marked for integer dot products, and
    the widened ones stay float32. The kernels' arithmetic is tested exactly in
    tests/kernels/test_kquant.py; a closeness bound on this tiny random model would say
    little: its flat, small-hidden layers turn int8 rounding into logprob gaps from 0.04 to 1.2
    (measured), as the order requests run in moves them."""
    fast = LLM(str(mixed_gguf), gguf_activations="int8")
    model = fast.engine.executor.runner.model
    layers = model.model.layers
    # Q6_K: layer 0's down_proj, layer 1's qkv_proj, the LM head; layer 2's qkv parts Q4_K,
    # Q4_K and Q6_K; its o_proj was F16, widened at conversion: float32, exact
    assert _type_of(layers[0].mlp.down_proj) == _type_of(model.lm_head) == "torch.int8"
    assert _type_of(layers[1].self_attn.qkv_proj) == _type_of(model.model.embed_tokens) == "torch.int8"
    assert _type_of(layers[2].self_attn.qkv_proj) == "torch.int8+torch.int8+torch.int8"
    assert layers[2].self_attn.o_proj.packed.dtype == torch.float32
    out = fast.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert all(math.isfinite(lp.logprob) for o in out for step in o.outputs[0].logprobs for lp in step.values())


def test_q5_0_gguf_computes_bitwise_as_its_float32_conversion(tmp_path):
    """Q5_0 everywhere (the embedding and LM head too): sampled and prompt logprobs bitwise
    those of the converted float32 checkpoint (gguf's dequantization), decode and prefill."""
    from make_tiny_gguf import make_tiny_gguf

    from pyserve.model.gguf import convert_gguf

    path = make_tiny_gguf(tmp_path / "tiny-q5_0.gguf", "Q5_0")
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    quantized = LLM(str(path), download_dir=str(tmp_path))
    model = quantized.engine.executor.runner.model
    assert _type_of(model.model.layers[0].mlp.down_proj) == "Q5_0"
    assert _type_of(model.model.embed_tokens) == "Q5_0" and _type_of(model.lm_head) == "Q5_0"
    ours = quantized.generate(PROMPTS, params)
    del quantized, model
    converted = convert_gguf(path, tmp_path / "float32")
    reference = LLM(str(converted)).generate(PROMPTS, params)
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs


def test_k_quant_blocks_split_inputs_on_whole_super_blocks():
    """A row-parallel shard of a K-quant weight takes whole super-blocks of 256 inputs."""
    from pyserve.errors import ModelLoadError
    from pyserve.model.layers.quantized import GGUFBlocks

    blocks = torch.arange(4 * 3 * 210, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(4, 3 * 210)
    weight = GGUFBlocks("Q6_K", blocks, (4, 768))
    second = weight.narrow(1, 256, 512)
    assert second.shape == (4, 512) and torch.equal(second.blocks, blocks[:, 210:])
    assert weight.narrow(0, 1, 2).shape == (2, 768)
    with pytest.raises(ModelLoadError, match="multiples of 256"):
        weight.narrow(1, 32, 256)
