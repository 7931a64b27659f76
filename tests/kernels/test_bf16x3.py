"""Float32 GEMMs as three bfloat16 products on AMX tiles (csrc/cpu/bf16x3.cpp), against a
float64 reference: within a relative error of 2e-5 (float32 BLAS: a few 1e-7; one bfloat16
product: a few 1e-3, which the test also shows it is far from). Runs where the CPU and the
build have AMX-BF16; elsewhere only the refusals are checked."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import _native
from pyserve.model.layers.linear import (ACTIVATIONS, ColumnParallelLinear, apply_linear,
                                         apply_linear_activation, pack_for_cpu)

amx = pytest.mark.skipif(not _native.bf16x3_supported(), reason="needs AMX-BF16 (CPU and build)")


def _relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).norm() / reference.norm()).item()


@amx
@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (31, 64, 96), (33, 384, 1152), (300, 1536, 384)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_close_to_float64(m, k, n, with_bias):
    gen = torch.Generator().manual_seed(m + k + n)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = _native.bf16x3_linear(x, _native.pack_bf16x3_weight(weight), n, bias)
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    assert _relative_error(out, reference) < 2e-5
    # what the two extra products buy: one bfloat16 product is far further off
    one_pass = F.linear(x.bfloat16(), weight.bfloat16()).double()
    assert _relative_error(one_pass, F.linear(x.double(), weight.double())) > 1e-3


@amx
def test_rows_with_a_stride_and_rows_alone():
    gen = torch.Generator().manual_seed(1)
    wide, weight = torch.randn(40, 160, generator=gen), torch.randn(64, 128, generator=gen)
    x = wide[:, 16:144]  # row stride 160
    packed = _native.pack_bf16x3_weight(weight)
    out = _native.bf16x3_linear(x, packed, 64)
    torch.testing.assert_close(out, _native.bf16x3_linear(x.contiguous(), packed, 64), rtol=0, atol=0)
    # each row's result is its own: the rows padded in with it are zeros that add nothing
    for row in (0, 17, 39):
        torch.testing.assert_close(out[row:row + 1], _native.bf16x3_linear(x[row:row + 1], packed, 64),
                                   rtol=0, atol=0)


@amx
def test_layer_packed_for_bf16x3_runs_it_at_every_row_count():
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    layer = ColumnParallelLinear(64, [96], True, torch.float32)
    layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
    pack_for_cpu(layer, bf16x3=True)
    assert layer.bf16x3_weight is not None and layer.packed is None and layer.weight.numel() == 0
    for rows in (1, 16, 300):
        x = torch.randn(rows, 64, generator=gen)
        out = apply_linear(x, layer, layer.bias)
        assert _relative_error(out, F.linear(x.double(), weight.double(), bias.double())) < 2e-5


def test_shapes_it_cannot_tile_keep_the_packed_kernel():
    layer = ColumnParallelLinear(48, [64], False, torch.float32)  # K = 48: not a multiple of 32
    layer.weight.data = torch.randn(64, 48)
    pack_for_cpu(layer, bf16x3=True)
    assert layer.bf16x3_weight is None and layer.packed is not None


def test_bad_weights_are_refused():
    with pytest.raises(RuntimeError, match="multiples of 32"):
        _native.pack_bf16x3_weight(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="float32"):
        _native.pack_bf16x3_weight(torch.randn(64, 64, dtype=torch.float64))


@amx
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_the_epilogue_activation_is_pytorchs(activation):
    """Fused into the epilogue, against PyTorch's op on the unfused output: within 2e-6 (the
    erf formula's error; float32 outputs here are of order 1)."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(70, 384, generator=gen), torch.randn(1536, 384, generator=gen) * 0.05
    bias = torch.randn(1536, generator=gen)
    packed = _native.pack_bf16x3_weight(weight)
    plain = _native.bf16x3_linear(x, packed, 1536, bias)
    fused = _native.bf16x3_linear(x, packed, 1536, bias, activation)
    torch.testing.assert_close(fused, ACTIVATIONS[activation](plain), atol=2e-6, rtol=0)
    layer = ColumnParallelLinear(384, [1536], True, torch.float32)
    layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
    pack_for_cpu(layer, bf16x3=True)
    torch.testing.assert_close(apply_linear_activation(x, layer, activation), fused, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="activation must be"):
        _native.bf16x3_linear(x, packed, 1536, bias, "silu")
