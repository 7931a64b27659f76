"""bfloat16 GEMMs for steps of many rows (--dtype bfloat16 on a CPU with AMX-BF16): below the
row threshold a layer is bitwise its packed kernel, from it bitwise one bfloat16 GEMM on the
rounded input, close to float32; the native decoder layers take the same branch as the Python
ones; the plan turns it on only where the CPU has AMX. On CPUs without AMX the detection (a
boundary we do not own) is patched, so the path is tested everywhere: oneDNN's bfloat16 GEMM
runs on any x86 CPU, only slower."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import LLM, SamplingParams, _native
from pyserve.model.layers.linear import (BF16_GEMM_MIN_ROWS, BF16_GEMM_MIN_ROWS_INT8,
                                         ColumnParallelLinear, apply_linear, pack_for_cpu)

from ..kernels.test_linear import _random_gguf_blocks


def _layer(weight: torch.Tensor, bias: torch.Tensor | None, bf16_gemm: bool) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(weight.shape[1], [weight.shape[0]], bias is not None, weight.dtype)
    layer.weight.data = weight.clone()
    if bias is not None:
        layer.bias.data = bias.clone()
    pack_for_cpu(layer, bf16_gemm=bf16_gemm)
    return layer


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_below_the_threshold_take_the_packed_kernel_and_above_one_bf16_gemm(weight_dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=gen).to(weight_dtype)
    bias = torch.randn(200, generator=gen) if with_bias else None
    gemm, plain = _layer(weight, bias, True), _layer(weight, bias, False)
    assert gemm.gemm_weight.dtype == torch.bfloat16 and plain.gemm_weight is None
    assert torch.equal(gemm.gemm_weight, weight.bfloat16())
    for rows in (1, 7, BF16_GEMM_MIN_ROWS - 1):
        x = torch.randn(rows, 96, generator=gen)
        assert torch.equal(apply_linear(x, gemm, gemm.bias), apply_linear(x, plain, plain.bias))
    for rows in (BF16_GEMM_MIN_ROWS, 100, 300):
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
def test_a_gguf_layer_keeps_its_dequantized_weight_in_bf16(int8):
    if int8 and not _native.int8_dot_supported():
        pytest.skip("no int8 dot-product kernel on this CPU")
    from pyserve.model.layers.quantized import GGUFBlocks

    blocks = torch.from_numpy(_random_gguf_blocks("Q4_1", 64, 128, seed=1))
    layer = ColumnParallelLinear(128, [64], False, torch.float32)
    layer.gguf = GGUFBlocks("Q4_1", blocks, (64, 128))
    pack_for_cpu(layer, int8_activations=int8, bf16_gemm=True)
    widened = _native.unpack_linear_weight(_native.pack_gguf_weight(blocks, 128, "Q4_1"), 64)
    assert torch.equal(layer.gemm_weight, widened.bfloat16())
    threshold = BF16_GEMM_MIN_ROWS_INT8 if int8 else BF16_GEMM_MIN_ROWS
    assert layer.max_packed_rows == threshold - 1
    x = torch.randn(threshold, 128)
    assert torch.equal(apply_linear(x, layer), F.linear(x.bfloat16(), widened.bfloat16()).float())


def _amx(monkeypatch, present: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)


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
    prompts = [list(range(3, 3 + 3 * BF16_GEMM_MIN_ROWS)), [5, 6, 7], list(range(10, 50))]
    native = _run(llm, prompts)
    for layer in layers:
        layer.native = None
    assert _run(llm, prompts) == native


def test_without_amx_bfloat16_weights_keep_float32_gemms(tiny_model_factory, monkeypatch):
    _amx(monkeypatch, False)
    llm = LLM(str(tiny_model_factory("llama")), dtype="bfloat16")
    assert "bfloat16 GEMMs" not in llm.engine.plan.weights
    assert all(layer.mlp.down_proj.gemm_weight is None
               for layer in llm.engine.executor.runner.model.model.layers)


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
