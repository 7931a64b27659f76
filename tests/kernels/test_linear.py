"""The CPU packed linear kernel against torch's F.linear on the same (widened) weights, and the
layers that use it against their unpacked selves."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyserve import _native
from pyserve.model.layers.embedding import VocabParallelEmbedding
from pyserve.model.layers.linear import PACKED_MAX_ROWS, ColumnParallelLinear, pack_for_cpu


def _reference(x, weight, bias=None):
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 12, 13, 16, 40, 300])  # row tiles of 12 and their tails
@pytest.mark.parametrize("n,k", [(960, 576), (577, 1536), (3, 13)])  # N not a multiple of 32
def test_packed_linear_matches_torch(weight_dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen)
    packed = _native.pack_linear_weight(weight)
    assert packed.shape == (-(-n // 32), k, 32) and packed.dtype == weight_dtype
    out = torch.full((m, n), float("nan"))
    _native.packed_linear(out, x, packed, bias)
    torch.testing.assert_close(out, _reference(x, weight, bias), atol=1e-4 * k ** 0.5, rtol=1e-4)
    _native.packed_linear(out, x, packed)  # no bias
    torch.testing.assert_close(out, _reference(x, weight), atol=1e-4 * k ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [13, 40, 300])  # above one row tile: the chunked path
@pytest.mark.parametrize("n,k", [(70, 200), (33, 13), (64, 1536)])  # k past whole 32s, k < 32
def test_float_rows_in_a_batch_equal_each_row_alone(weight_dtype, m, n, k):
    """A float panel meets many rows 128 k at a time, one row in one pass: each output still
    sums its k in order, so a row's result does not depend on its batch, bit for bit (a
    decode row and the same row in a prefill or a verify step agree)."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen)
    packed = _native.pack_linear_weight(torch.randn(n, k, generator=gen).to(weight_dtype))
    bias = torch.randn(n, generator=gen)
    batch = torch.empty(m, n)
    _native.packed_linear(batch, x, packed, bias)
    alone = torch.empty(1, n)
    for row in range(m):
        _native.packed_linear(alone, x[row:row + 1].contiguous(), packed, bias)
        assert torch.equal(batch[row], alone[0]), row


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_unpack_gives_back_the_weight_widened(weight_dtype):
    weight = torch.randn(77, 40).to(weight_dtype)
    unpacked = _native.unpack_linear_weight(_native.pack_linear_weight(weight), 77)
    assert unpacked.dtype == torch.float32
    assert torch.equal(unpacked, weight.float())


def test_packed_linear_refuses_what_it_cannot_do():
    packed = _native.pack_linear_weight(torch.randn(4, 8))
    out = torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="float32"):
        _native.packed_linear(out, torch.randn(2, 8).double(), packed)
    with pytest.raises(RuntimeError, match="x has 9 columns, the weight 8"):
        _native.packed_linear(out, torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match="contiguous"):
        _native.packed_linear(out, torch.randn(8, 2).t(), packed)
    with pytest.raises(RuntimeError, match="out must be"):
        _native.packed_linear(torch.empty(2, 40), torch.randn(2, 8), packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _native.pack_linear_weight(torch.randn(4, 8).half())


@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1])  # both kernels
def test_packed_layer_equals_unpacked(rows):
    layer = ColumnParallelLinear(64, [48, 48], True, torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(rows, 64)
    expected = layer(x)
    pack_for_cpu(layer)
    assert layer.weight.numel() == 0  # the unpacked copy is gone
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)


def test_packed_embedding_looks_up_and_scores_like_the_table():
    table = VocabParallelEmbedding(100, 24, torch.float32)
    table.weight.data = torch.randn(100, 24).bfloat16()
    ids = torch.tensor([0, 31, 32, 99, 5, 5])
    expected_rows = table(ids)
    hidden = torch.randn(3, 24)
    expected_logits = table.logits(hidden, 100)
    pack_for_cpu(table)
    assert torch.equal(table(ids), expected_rows)
    torch.testing.assert_close(table.logits(hidden, 100), expected_logits, atol=1e-5, rtol=1e-5)


def test_packed_lm_head_writes_decode_logits_into_one_reused_buffer():
    """A decode step's logits go into a buffer the layer keeps (no fresh 16 MB a step for
    Gemma's vocabulary), bitwise what a fresh tensor gets; many rows allocate their own."""
    from pyserve.model.layers.embedding import REUSED_LOGITS_ROWS

    table = VocabParallelEmbedding(100, 24, torch.float32)
    table.weight.data = torch.randn(100, 24)
    pack_for_cpu(table)
    gen = torch.Generator().manual_seed(0)
    first = table.logits(torch.randn(16, 24, generator=gen), 100)
    buffer = first.data_ptr()
    for rows in (16, 3, 16):
        hidden = torch.randn(rows, 24, generator=gen)
        fresh = torch.empty(rows, table.out_features)
        _native.packed_linear(fresh, hidden, table.packed, None)
        logits = table.logits(hidden, 100)
        assert logits.data_ptr() == buffer and torch.equal(logits, fresh[:, :100])
    many = table.logits(torch.randn(REUSED_LOGITS_ROWS + 1, 24, generator=gen), 100)
    assert many.data_ptr() != buffer


def _random_gguf_blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks [n, k / 32 * block bytes] with sane float16 scales and random quants."""
    rng = np.random.default_rng(seed)
    groups = k // 32
    d = rng.uniform(1e-3, 0.05, (n, groups, 1)).astype(np.float16).view(np.uint8)
    if kind == "Q4_1":
        m = rng.uniform(-0.4, 0.0, (n, groups, 1)).astype(np.float16).view(np.uint8)
        qs = rng.integers(0, 256, (n, groups, 16), dtype=np.uint8)
        blocks = np.concatenate([d, m, qs], axis=2)
    else:
        qs = rng.integers(-128, 128, (n, groups, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d, qs], axis=2)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def _gguf_dequantized(kind: str, blocks: np.ndarray, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
# 11 panels: one row takes them two at a time on AVX-512, over threads' odd-length ranges
@pytest.mark.parametrize("n,k", [(96, 64), (70, 576), (5, 32), (352, 96)])
def test_gguf_weights_compute_exactly_as_their_dequantized_float32(kind, n, k):
    """The kernel dequantizes as the gguf package does, so a quantized layer's output is
    bitwise the float32 layer's on the package's dequantized weights, at every row count."""
    blocks = _random_gguf_blocks(kind, n, k, seed=n + k)
    reference = _gguf_dequantized(kind, blocks, n, k)
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind)
    assert torch.equal(_native.unpack_linear_weight(packed, n), reference)
    ids = torch.tensor([0, n - 1, n // 2, 0])
    assert torch.equal(_native.packed_rows(packed, ids), reference[ids])
    as_float = _native.pack_linear_weight(reference)
    bias = torch.randn(n)
    for m in (1, 3, 12, 13, 16, 29, 200, 500):  # direct tiles; L1 chunks of 4 groups; 500 rows
        # of k = 576 span two row chunks
        x = torch.randn(m, k)
        out_q, out_f = torch.empty(m, n), torch.empty(m, n)
        _native.packed_linear(out_q, x, packed, bias)
        _native.packed_linear(out_f, x, as_float, bias)
        assert torch.equal(out_q, out_f)
        torch.testing.assert_close(out_q, _reference(x, reference, bias), atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_pack_gguf_weight_refuses_what_it_cannot_do():
    blocks = torch.from_numpy(_random_gguf_blocks("Q4_1", 4, 64, seed=0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _native.pack_gguf_weight(blocks, 48, "Q4_1")
    with pytest.raises(RuntimeError, match="take 40 bytes, got 40|take 68 bytes, got 40"):
        _native.pack_gguf_weight(blocks, 64, "Q8_0")
    with pytest.raises(RuntimeError, match="Q4_1, Q5_0, Q8_0"):
        _native.pack_gguf_weight(blocks, 64, "Q2_K")
    with pytest.raises(RuntimeError, match="outside"):
        _native.packed_rows(_native.pack_gguf_weight(blocks, 64, "Q4_1"), torch.tensor([32]))


def _int8_activation_reference(kind: str, x: torch.Tensor, blocks: np.ndarray, n: int, k: int, bias):
    """The int8-activation product in float64 from its definition: x quantized per row and
    block of 32 to round(x · 127 / max |x|) (float32 steps, round half to even), each block's
    integer dot product with the weight's q exact, then d · (max |x| / 127) · Σ q·qx, plus
    m · Σ x for Q4_1."""
    groups = k // 32
    raw = blocks.reshape(n, groups, -1)
    d = torch.from_numpy(raw[:, :, 0:2].copy().view(np.float16).astype(np.float64)).reshape(n, groups)
    if kind == "Q4_1":
        mins = torch.from_numpy(raw[:, :, 2:4].copy().view(np.float16).astype(np.float64)).reshape(n, groups)
        nibbles = torch.from_numpy(raw[:, :, 4:].astype(np.int64))
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=2)  # [n, groups, 32]: k 0..15, then 16..31
    else:
        mins = torch.zeros(n, groups, dtype=torch.float64)
        q = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).astype(np.int64))
    xb = x.reshape(x.shape[0], groups, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inv).to(torch.int64)  # [m, groups, 32]
    scale = (amax / 127.0).double().squeeze(2)  # [m, groups]
    dots = torch.einsum("mgk,ngk->mng", qx, q).double()  # exact integers
    out = (dots * d[None] * scale[:, None]).sum(2) + (mins[None] * xb.double().sum(2)[:, None]).sum(2)
    return (out + (0 if bias is None else bias.double())).float()


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 300, 1100])  # row tiles of 6, their tails, chunks
@pytest.mark.parametrize("n,k", [(96, 64), (70, 576), (5, 32), (577, 1536)])
def test_int8_activations_equal_their_definition(kind, m, n, k):
    blocks = _random_gguf_blocks(kind, n, k, seed=m + n + k)
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind, int8_activations=True)
    assert packed.dtype == torch.int8
    exact = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind)
    # the same bytes, marked; Q8_0 lays its bytes out for each kernel (k-major for float32)
    assert torch.equal(packed.view(torch.uint8), exact) == (kind != "Q8_0")
    x = torch.randn(m, k) * torch.rand(m, 1) * 4
    x[0, :32] = 0  # an all-zero block has scale 0
    bias = torch.randn(n)
    out = torch.empty(m, n)
    _native.packed_linear(out, x, packed, bias)
    expected = _int8_activation_reference(kind, x, blocks, n, k, bias)
    # float32 accumulation over k / 32 blocks of terms up to a few units
    torch.testing.assert_close(out, expected, atol=2e-5 * k ** 0.5, rtol=1e-5)
    # and the 8-bit rounding of x keeps it near the float32 product
    float_out = torch.empty(m, n)
    _native.packed_linear(float_out, x, exact, bias)
    error = (out - float_out).norm() / float_out.norm()
    assert error < 0.02, error
    # the rest of the format reads the marked weight as the unmarked one
    assert torch.equal(_native.unpack_linear_weight(packed, n), _native.unpack_linear_weight(exact, n))
