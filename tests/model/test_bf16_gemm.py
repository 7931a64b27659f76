"""bfloat16 GEMMs for steps of many rows (--dtype bfloat16 on a CPU with AMX-BF16 or AVX-512
BF16): below the row threshold a layer is bitwise its packed kernel, from it bitwise one
bfloat16 GEMM on the rounded input, close to float32; the native decoder layers take the same
branch as the Python ones; the plan turns it on only where the CPU has either, with that
hardware's thresholds. Where the CPU has neither, the detection (a boundary we do not own) is
patched, so the path is tested everywhere: oneDNN's bfloat16 GEMM runs on any x86 CPU, only
slower."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import LLM, SamplingParams, _native
from pyserve.model.layers.linear import (BF16_GEMM_AMX, BF16_GEMM_AVX512, ColumnParallelLinear,
                                         apply_linear, pack_for_cpu)

from ..kernels.test_linear import _random_gguf_blocks

THRESHOLDS = [BF16_GEMM_AMX, BF16_GEMM_AVX512]


def _layer(weight: torch.Tensor, bias: torch.Tensor | None, bf16_gemm) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(weight.shape[1], [weight.shape[0]], bias is not None, weight.dtype)
    layer.weight.data = weight.clone()
    if bias is not None:
        layer.bias.data = bias.clone()
    pack_for_cpu(layer, bf16_gemm=bf16_gemm)
    return layer


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("thresholds", THRESHOLDS, ids=lambda t: t.hardware)
def test_rows_below_the_threshold_take_the_packed_kernel_and_above_one_bf16_gemm(weight_dtype, with_bias,
                                                                                   thresholds):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=gen).to(weight_dtype)
    bias = torch.randn(200, generator=gen) if with_bias else None
    gemm, plain = _layer(weight, bias, thresholds), _layer(weight, bias, None)
    assert gemm.gemm_weight.dtype == torch.bfloat16 and plain.gemm_weight is None
    assert torch.equal(gemm.gemm_weight, weight.bfloat16())
    threshold = thresholds.float_panels
    assert gemm.max_packed_rows == threshold - 1
    for rows in (1, 7, threshold - 1):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.equal(apply_linear(x, gemm, gemm.bias), apply_linear(x, plain, plain.bias))
    for rows in (threshold, 100, 300):
        x = torch.randn(rows, 96, generator=gen)
        out = apply_linear(x, gemm, gemm.bias)
        expected = F.linear(x.bfloat16(), weight.bfloat16()).float()
        if bias is not None:
            expected = expected + bias
        assert out.dtype == torch.float32 and torch.equal(out, expected)
        exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        # input and output each rounded to bfloat16 (8 bits of mantissa): a few parts in 1,000
        # of the sums' scale
        scale = (x.double().abs() @ weight.double().abs().T).max()
        assert ((out.double() - exact).abs().max() / scale) < 1e-2


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("thresholds", THRESHOLDS, ids=lambda t: t.hardware)
def test_a_gguf_layer_keeps_its_dequantized_weight_in_bf16(int8, thresholds):
    """A GGUF layer takes its panel kind's threshold; where int8 panels outrun the bfloat16
    GEMM at every row count (AVX-512 BF16 without AMX) the layer keeps no bfloat16 copy and
    its packed kernel takes every row."""
    if int8 and not _native.int8_dot_supported():
        pytest.skip("no int8 dot-product kernel on this CPU")
    from pyserve.model.layers.quantized import GGUFBlocks

    blocks = torch.from_numpy(_random_gguf_blocks("Q4_1", 64, 128, seed=1))
    layer = ColumnParallelLinear(128, [64], False, torch.float32)
    layer.gguf = GGUFBlocks("Q4_1", blocks, (64, 128))
    pack_for_cpu(layer, int8_activations=int8, bf16_gemm=thresholds)
    widened = _native.unpack_linear_weight(_native.pack_gguf_weight(blocks, 128, "Q4_1"), 64)
    threshold = thresholds.int8_panels if int8 else thresholds.gguf_panels
    x = torch.randn(threshold or 300, 128)
    if threshold is None:
        assert layer.gemm_weight is None and layer.max_packed_rows == torch.iinfo(torch.int64).max
        out = torch.empty(x.shape[0], 64)
        _native.packed_linear(out, x, layer.packed, None)
        assert torch.equal(apply_linear(x, layer), out)
        return
    assert torch.equal(layer.gemm_weight, widened.bfloat16())
    assert layer.max_packed_rows == threshold - 1
    assert torch.equal(apply_linear(x, layer), F.linear(x.bfloat16(), widened.bfloat16()).float())


def _bf16_hardware(monkeypatch, amx: bool, avx512_bf16: bool | None = None) -> None:
    """What the CPU detection reports: AMX (which implies AVX-512 BF16 unless told), or not."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    avx512_bf16 = amx if avx512_bf16 is None else avx512_bf16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def _amx(monkeypatch, present: bool) -> None:
    _bf16_hardware(monkeypatch, present)


def _run(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
            for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv bias after the GEMM
def test_native_layers_take_the_bf16_gemm_as_the_python_layers_do(tiny_model_factory, monkeypatch, arch):
    _amx(monkeypatch, True)
    llm = LLM(str(tiny_model_factory(arch)), dtype="bfloat16", max_num_batched_tokens=512)
    model = llm.engine.executor.runner.model
    layers = model.model.layers
    assert all(layer.native is not None for layer in layers)
    assert all(layer.mlp.down_proj.gemm_weight is not None for layer in layers)
    assert getattr(model.lm_head, "gemm_weight", None) is None  # few rows a step
    prompts = [list(range(3, 3 + 3 * BF16_GEMM_AMX.float_panels)), [5, 6, 7], list(range(10, 50))]
    native = _run(llm, prompts)
    for layer in layers:
        layer.native = None
    assert _run(llm, prompts) == native


def test_without_amx_or_avx512_bf16_bfloat16_weights_keep_float32_gemms(tiny_model_factory, monkeypatch):
    _amx(monkeypatch, False)
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16")
    assert "bfloat16 GEMMs" not in llm.engine.plan.weights
    assert all(layer.mlp.down_proj.gemm_weight is None
               for layer in llm.engine.executor.runner.model.model.layers)


def test_avx512_bf16_without_amx_takes_its_own_thresholds(tiny_model_factory, monkeypatch):
    """A Zen 4-like CPU (AVX-512 BF16, no AMX): the plan says so and the layers switch to the
    bfloat16 GEMM from that hardware's float-panel threshold; a long prompt's logprobs stay
    near those of the float32 GEMMs (a tiny random model's flat logits make its greedy tokens
    a poor check: bfloat16 rounding flips near-ties)."""
    _bf16_hardware(monkeypatch, amx=False, avx512_bf16=True)
    path = str(tiny_model_factory("llama"))
    llm = LLM(path, dtype="bfloat16", max_num_batched_tokens=512)
    assert f"bfloat16 GEMMs (AVX-512 BF16) from {BF16_GEMM_AVX512.float_panels} rows" in llm.engine.plan.weights
    layers = llm.engine.executor.runner.model.model.layers
    assert all(layer.mlp.down_proj.max_packed_rows == BF16_GEMM_AVX512.float_panels - 1 for layer in layers)
    prompt = list(range(3, 3 + 4 * BF16_GEMM_AVX512.float_panels))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(engine) -> torch.Tensor:
        scored = engine.generate([prompt], params)[0].prompt_logprobs[1:]
        return torch.tensor([entry[token].logprob for entry, token in zip(scored, prompt[1:])])

    narrow = prompt_logprobs(llm)
    llm.shutdown()
    _amx(monkeypatch, False)
    wide = prompt_logprobs(LLM(path, dtype="bfloat16", max_num_batched_tokens=512))
    assert not torch.equal(narrow, wide)  # the bfloat16 GEMM did run
    torch.testing.assert_close(narrow, wide, atol=0, rtol=2e-2)  # bfloat16: 8 bits of mantissa


def test_bert_embeddings_with_bf16_gemms_stay_close_to_float32(tmp_path, monkeypatch):
    from make_tiny_bert import make_tiny_bert

    _amx(monkeypatch, True)
    path = make_tiny_bert(tmp_path / "bert")
    texts = ["Sentence embeddings map a text to one vector; similar texts get nearby vectors. " * 2,
             "Paris is the capital of France.", "short"]
    full = LLM(str(path), dtype="float32")
    narrow = LLM(str(path), dtype="bfloat16")
    linears = [m for m in narrow.engine.executor.runner.model.modules()
               if isinstance(m, ColumnParallelLinear)]
    assert linears and all(m.gemm_weight is not None for m in linears)
    for a, b in zip(full.embed(texts), narrow.embed(texts)):
        a, b = torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding)
        assert F.cosine_similarity(a, b, dim=0) > 0.999
