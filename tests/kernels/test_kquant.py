"""GGUF's Q4_0, Q5_0, Q4_K, Q5_K and Q6_K blocks in the CPU packed linear kernel (csrc/cpu/
linear_kquant.h): dequantized bit for bit as gguf.quants.dequantize, random blocks with extreme
float16 scales included; the packed product bitwise that of the float32 kernel on the
dequantized weight, and within float32 accumulation error of a float64 matmul; the embedding
lookup; the int8-activation kernel of the nibble types near the exact one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyserve import _native

TYPES = ["Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
# weights per block, bytes per block, and where each block's float16 scales sit
LAYOUT = {"Q4_0": (32, 18, (0,)), "Q5_0": (32, 22, (0,)), "Q4_K": (256, 144, (0, 2)),
          "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}
# float16 max, min normal, a subnormal, the smallest subnormal, zeros, negatives, and the
# ordinary range (as float16 bit patterns are widened by the kernel)
EXTREME_SCALES = np.array([65504.0, -65504.0, 6.104e-5, 3.0e-6, 5.96e-8, -5.96e-8, 0.0, -0.0,
                           1.0, -2.5, 0.01, 3e-3], dtype=np.float16)


def random_blocks(kind: str, n: int, k: int, seed: int, extreme: bool = False) -> np.ndarray:
    """Raw GGUF blocks [n, k / block * bytes]: random bytes for the quants and integer scales,
    float16 scales from the ordinary range (1e-3 .. 0.05, either sign) or the extreme set."""
    block, size, scale_at = LAYOUT[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in scale_at:
        if extreme:
            scales = rng.choice(EXTREME_SCALES, (n, k // block))
        else:
            scales = (rng.uniform(1e-3, 0.05, (n, k // block)) * rng.choice([-1, 1], (n, k // block)))
        blocks[:, :, at:at + 2] = scales.astype(np.float16).view(np.uint8).reshape(n, k // block, 2)
    return np.ascontiguousarray(blocks.reshape(n, -1))


def gguf_dequantized(kind: str, blocks: np.ndarray, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType[kind]).reshape(n, k).astype(np.float32))


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns: equal tensors here are equal in the sign of every zero too"""
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("n,k", [(64, 256), (37, 512), (5, 768)])  # N not a multiple of 32
def test_dequantized_bit_for_bit_as_gguf(kind, extreme, n, k):
    blocks = random_blocks(kind, n, k, seed=n + k + extreme, extreme=extreme)
    reference = gguf_dequantized(kind, blocks, n, k)
    assert torch.isfinite(reference).all()
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind)
    assert packed.dtype == torch.uint8 and packed.shape[:2] == (-(-n // 32), k // LAYOUT[kind][0])
    assert torch.equal(bits(_native.unpack_linear_weight(packed, n)), bits(reference))
    # the embedding lookup reads single rows through the scalar path
    ids = torch.tensor([0, n - 1, n // 2, 0, 3 % n])
    assert torch.equal(bits(_native.packed_rows(packed, ids)), bits(reference[ids]))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("n,k", [(96, 256), (70, 768), (5, 512)])
def test_packed_linear_equals_dequantize_then_matmul(kind, n, k):
    """Bitwise the float32 kernel on the dequantized weight (the same sums in the same order),
    at every row count (direct tiles, their tails, the L1-chunked path, two row chunks); and
    within float32 accumulation error of a float64 matmul: atol 1e-4 · sqrt(k), rtol 1e-4, as
    the float32 kernel's own test."""
    blocks = random_blocks(kind, n, k, seed=7 * n + k)
    reference = gguf_dequantized(kind, blocks, n, k)
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind)
    as_float = _native.pack_linear_weight(reference)
    gen = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 12, 13, 16, 29, 200, 700):
        x = torch.randn(m, k, generator=gen)
        out_q, out_f = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
        _native.packed_linear(out_q, x, packed, bias)
        _native.packed_linear(out_f, x, as_float, bias)
        assert torch.equal(bits(out_q), bits(out_f)), m
        expected = F.linear(x.double(), reference.double(), bias.double()).float()
        torch.testing.assert_close(out_q, expected, atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_k_quants_need_whole_super_blocks():
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 256, seed=0))
    with pytest.raises(RuntimeError, match="multiple of 256 for Q4_K"):
        _native.pack_gguf_weight(blocks[:, :72], 128, "Q4_K")
    with pytest.raises(RuntimeError, match="take 288 bytes, got 144"):
        _native.pack_gguf_weight(blocks, 512, "Q4_K")
    with pytest.raises(RuntimeError, match="type must be"):
        _native.pack_gguf_weight(blocks, 256, "Q3_K")
    packed = _native.pack_gguf_weight(blocks, 256, "Q4_K")
    with pytest.raises(RuntimeError, match="columns"):
        _native.packed_linear(torch.empty(1, 4), torch.randn(1, 512), packed, None)


@pytest.mark.parametrize("kind", TYPES)
def test_every_kept_type_has_an_int8_kernel(kind):
    """int8_activations asks for integer dot products: every type kept quantized has that
    kernel, so each comes back marked (int8) over the same bytes."""
    blocks = torch.from_numpy(random_blocks(kind, 40, 256, seed=3))
    packed = _native.pack_gguf_weight(blocks, 256, kind, int8_activations=True)
    assert packed.dtype == torch.int8
    assert torch.equal(packed.view(torch.uint8), _native.pack_gguf_weight(blocks, 256, kind))


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 4, 6, 7, 300])
@pytest.mark.parametrize("n,k", [(70, 512), (5, 256)])
def test_int8_activations_stay_near_the_exact_product(kind, m, n, k):
    """The nibble types share Q4_1's int8 kernel (w = d·q + m per 32 k, with Q4_0's m = -8 d,
    Q5_0's -16 d and the K-quants' sub-block d·sc and -dmin·m; Q5_0 and Q5_K add their fifth
    bits to the nibbles), Q6_K has its own (a scale per 16 k): x rounded to 8 bits per 32 k keeps
    the product within 2 % of the exact one (a wrong scale or nibble is off by far more); 4 % for
    Q6_K, whose random signed scales and centred q make sums that cancel more, so that the same
    rounding of x is a larger share of them (its exact definition is tested below)."""
    blocks = torch.from_numpy(random_blocks(kind, n, k, seed=m + n + k))
    packed = _native.pack_gguf_weight(blocks, k, kind, int8_activations=True)
    exact = _native.pack_gguf_weight(blocks, k, kind)
    assert packed.dtype == torch.int8 and torch.equal(packed.view(torch.uint8), exact)
    gen = torch.Generator().manual_seed(m * n + k)  # fixed inputs: the bound is not a tail bound
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    bias = torch.randn(n, generator=gen)
    out, float_out = torch.empty(m, n), torch.empty(m, n)
    _native.packed_linear(out, x, packed, bias)
    _native.packed_linear(float_out, x, exact, bias)
    error = (out - float_out).norm() / float_out.norm()
    assert error < (0.04 if kind == "Q6_K" else 0.02), error
    assert torch.equal(_native.unpack_linear_weight(packed, n), _native.unpack_linear_weight(exact, n))


def _zero_quants(kind: str, blocks: np.ndarray) -> np.ndarray:
    """The blocks with every q 0 (their nibbles and fifth bits cleared), scales kept: what they
    dequantize to is each 32 k's offset m (-16 d for Q5_0, -dmin·m for Q5_K), exactly."""
    _, size, _ = LAYOUT[kind]
    raw = blocks.reshape(blocks.shape[0], -1, size).copy()
    # Q5_0: d, then qh[4] and qs[16]; Q5_K: d, dmin, scales[12], then qh[32] and qs[128]
    raw[:, :, 2 if kind == "Q5_0" else 16:] = 0
    return np.ascontiguousarray(raw.reshape(blocks.shape))


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
@pytest.mark.parametrize("kind", ["Q5_0", "Q5_K"])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 7, 300])  # row tiles of 4 (AVX2) and 6, tails
@pytest.mark.parametrize("n,k", [(70, 512), (5, 256), (96, 768)])
def test_int8_fifth_bit_types_equal_their_definition(kind, m, n, k):
    """The int8 product of Q5_0 / Q5_K from its definition, in float64: per row and 32 k, x
    rounded to qx = round(x · 127 / max |x|) (scale sx = max |x| / 127), and with w = d·q + m
    the block adds d·sx·Σ q·qx + m·Σ x, which is Σ w·sx·qx + m·(Σ x - sx·Σ qx): the weights w
    from gguf's dequantization, m from the same blocks with every q 0. A fifth bit read from the
    wrong k moves q by 16 and the result far outside the tolerance."""
    blocks = random_blocks(kind, n, k, seed=11 * m + n + k)
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind, int8_activations=True)
    assert packed.dtype == torch.int8
    w = gguf_dequantized(kind, blocks, n, k).double()
    offsets = gguf_dequantized(kind, _zero_quants(kind, blocks), n, k).double()
    groups = k // 32
    m_g = offsets.reshape(n, groups, 32)[:, :, 0]  # [n, groups]: one offset per 32 k
    assert torch.equal(offsets.reshape(n, groups, 32), m_g[:, :, None].expand(n, groups, 32))
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, :32] = 0  # an all-zero block has scale 0
    bias = torch.randn(n, generator=gen)
    xb = x.reshape(m, groups, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inv)  # float32 steps, round half to even
    sx = (amax / 127.0).double()
    x_hat = (qx.double() * sx).reshape(m, k)
    correction = xb.double().sum(2) - (sx.squeeze(2) * qx.double().sum(2))  # [m, groups]
    expected = (x_hat @ w.T + correction @ m_g.T + bias.double()).float()
    out = torch.empty(m, n)
    _native.packed_linear(out, x, packed, bias)
    torch.testing.assert_close(out, expected, atol=5e-5 * k ** 0.5, rtol=1e-5)


@pytest.mark.skipif(not _native.int8_dot_supported(), reason="needs AVX2 or AVX-512 VNNI")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 300])  # row tiles of 2 (AVX2) and 4, tails
@pytest.mark.parametrize("n,k", [(70, 512), (5, 256), (96, 768)])
@pytest.mark.parametrize("extreme", [False, True])
def test_int8_q6_k_equals_its_definition(m, n, k, extreme):
    """Q6_K's int8 product from its definition, in float64: per row and 32 k, x rounded to qx =
    round(x · 127 / max |x|) (scale sx = max |x| / 127); w = d·sc·(q - 32) has no offset, so the
    product is x̂ · wᵀ with x̂ = sx·qx and w from gguf's dequantization. The kernel sums each 16
    k's q·qx in integers, takes 32·Σ qx off and scales by d·sc·sx: a high bit read from the
    wrong k moves q by 16 or more, a scale from the wrong 16 k changes a whole half, both far
    outside the bound (float32 rounding of each 16 k's scaled sum, and of the sum over k)."""
    blocks = random_blocks("Q6_K", n, k, seed=13 * m + n + k + extreme, extreme=extreme)
    w = gguf_dequantized("Q6_K", blocks, n, k).double()
    if extreme:  # float16 extremes times sc·(q - 32) overflow float32's range in the sums
        w_scale = w.abs().amax(dim=1, keepdim=True)
        keep = (w_scale < 1e4).squeeze(1)
        blocks, w, n = blocks[keep.numpy()], w[keep], int(keep.sum())
    packed = _native.pack_gguf_weight(torch.from_numpy(np.ascontiguousarray(blocks)), k, "Q6_K",
                                      int8_activations=True)
    assert packed.dtype == torch.int8
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, :32] = 0  # an all-zero block has scale 0
    bias = torch.randn(n, generator=gen)
    xb = x.reshape(m, k // 32, 32)
    amax = xb.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(xb * inv)  # float32 steps, round half to even
    x_hat = (qx.double() * (amax / 127.0).double()).reshape(m, k)
    expected = x_hat @ w.T + bias.double()
    magnitude = x_hat.abs() @ w.abs().T + bias.double().abs()
    out = torch.empty(m, n)
    _native.packed_linear(out, x, packed, bias)
    error = (out.double() - expected).abs()
    assert (error <= 1e-6 * magnitude + 1e-30).all(), (error / magnitude).max()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_int8_one_row_equals_the_same_row_among_others(kind):
    """A decode row takes its own one-row int8 tile (AVX2: one pass over the panel, where
    tiles of several rows walk it once per 8 columns): bitwise the result that row gets
    inside a tile of several rows."""
    if not _native.int8_dot_supported():
        pytest.skip("this build has no int8 dot-product kernel")
    n, k = 70, 512
    blocks = random_blocks(kind, n, k, seed=5)
    packed = _native.pack_gguf_weight(torch.from_numpy(blocks), k, kind, int8_activations=True)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    together = torch.empty(5, n)
    _native.packed_linear(together, x, packed, None)
    for r in range(5):
        alone = torch.empty(1, n)
        _native.packed_linear(alone, x[r:r + 1].contiguous(), packed, None)
        assert torch.equal(bits(alone), bits(together[r:r + 1]))
