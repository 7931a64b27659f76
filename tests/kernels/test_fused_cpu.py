"""The CPU fused layer ops against the PyTorch code they replace (pyserve/model/layers/)."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import _native
from pyserve.model.layers.norm import RMSNorm
from pyserve.model.layers.rotary import RotaryEmbedding


def reference_rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 64), (300, 960)])
def test_rms_norm_and_fused_add(rows, hidden):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    out = torch.empty_like(x)
    _native.rms_norm(out, x, weight, 1e-5)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-5), atol=1e-6, rtol=1e-5)
    expected_residual = x + residual
    expected = reference_rms_norm(expected_residual, weight, 1e-5)
    _native.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-5)


def test_rms_norm_layer_takes_the_native_path_and_agrees_with_its_torch_path():
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(5, 64)
    torch.testing.assert_close(norm(x), norm._norm(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scaling", [None, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0,
                                                original_max_position_embeddings=64)])
def test_rotary_is_bitwise_the_torch_formula_on_strided_qk(scaling):
    rotary = RotaryEmbedding(64, 512, 10000.0, scaling)
    tokens, hq, hkv, d = 9, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
    positions = torch.randint(0, 512, (tokens,))
    cos = rotary.cos[positions].unsqueeze(1)
    sin = rotary.sin[positions].unsqueeze(1)
    expected_q, expected_k = rotary._rotate(q, cos, sin), rotary._rotate(k, cos, sin)
    out_q, out_k = rotary(positions, q, k)  # in place, through the strided views
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    assert torch.equal(qkv[:, : hq * d].view(tokens, hq, d), expected_q)


def test_silu_and_mul():
    x = torch.randn(6, 2 * 1536)
    out = torch.empty(6, 1536)
    _native.silu_and_mul(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :1536]) * x[:, 1536:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows,hidden", [(16, 576), (64, 1536)])
def test_a_batch_split_over_threads_gives_each_row_what_it_gets_alone(rows, hidden):
    # a decode batch's rows are shared among the threads (a few thousand elements each):
    # every row must come out bitwise as it does when it is the only row of its call
    gen = torch.Generator().manual_seed(hidden)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    gate_up = torch.randn(rows, 2 * hidden, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        normed, act = torch.empty_like(x), torch.empty(rows, hidden)
        _native.rms_norm(normed, x, weight, 1e-5)
        _native.silu_and_mul(act, gate_up)
        fused_x, fused_res = x.clone(), residual.clone()
        _native.fused_add_rms_norm(fused_x, fused_res, weight, 1e-5)
        for r in range(rows):
            one, one_act = torch.empty(1, hidden), torch.empty(1, hidden)
            _native.rms_norm(one, x[r:r + 1].clone(), weight, 1e-5)
            _native.silu_and_mul(one_act, gate_up[r:r + 1].clone())
            one_x, one_res = x[r:r + 1].clone(), residual[r:r + 1].clone()
            _native.fused_add_rms_norm(one_x, one_res, weight, 1e-5)
            assert torch.equal(normed[r], one[0]) and torch.equal(act[r], one_act[0])
            assert torch.equal(fused_x[r], one_x[0]) and torch.equal(fused_res[r], one_res[0])
    finally:
        torch.set_num_threads(threads)
