"""The fused CUDA ops (rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul) against
the PyTorch code that defines them (pyserve/model/layers/), run on the same GPU tensors.

Tolerances: kernel and reference compute in float32 and round where the PyTorch code rounds,
so they differ by at most about one ulp of the dtype (the reference rounds some intermediate
products the kernel keeps in float32): bfloat16 1e-2, float16 1e-3, float32 1e-5, absolute and
relative; against their CPU twins in float32, 1e-5."""

import pytest
import torch
import torch.nn.functional as F

from pyserve import _native
from pyserve.model.layers.rotary import RotaryEmbedding

ops = _native
CUDA = torch.cuda.is_available() and _native.built_with_cuda()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of pyserve._C")

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def close(actual, expected, dtype, what):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol,
                               msg=lambda m: f"{what}: {m}")


def rms_norm_reference(x, weight, eps):
    """norm.py's RMSNorm._norm: statistics in float32, normalised row rounded, then * weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_reference(positions, x, cos_sin_cache, is_neox):
    """x [T, heads, D]; rotates the first rot_dim elements of each head, in float32."""
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    rot, rest = xf[..., :rot_dim], xf[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rot, rest), dim=-1).to(x.dtype)


@pytest.mark.cuda
@needs_cuda
def test_rms_norm():
    gen = torch.Generator("cuda").manual_seed(0)
    for dtype in DTYPES:
        # hidden sizes: vectorised, a non-power of two, and one that needs the scalar path
        for shape in ((7, 4096), (3, 5120), (5, 1000), (2, 3, 256), (1, 8192)):
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device="cuda")).to(dtype)
            out = torch.empty_like(x)
            ops.rms_norm(out, x, w, 1e-5)
            close(out, rms_norm_reference(x, w, 1e-5), dtype, f"rms_norm {dtype} {shape}")
        # rows of a wider tensor (strided rows)
        wide = torch.randn(6, 2 * 4096, generator=gen, device="cuda").to(dtype)
        x = wide[:, :4096]
        out = torch.empty(6, 4096, device="cuda", dtype=dtype)
        ops.rms_norm(out, x, w[:1].expand(4096).contiguous(), 1e-6)
        close(out, rms_norm_reference(x, w[:1].expand(4096), 1e-6), dtype, f"rms_norm strided {dtype}")


@pytest.mark.cuda
@needs_cuda
def test_fused_add_rms_norm():
    gen = torch.Generator("cuda").manual_seed(1)
    for dtype in DTYPES:
        for shape in ((7, 4096), (4, 1000), (2, 3, 512)):
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            residual = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, device="cuda")).to(dtype)
            summed = residual + x  # norm.py: x = residual + x, in the dtype
            expected = rms_norm_reference(summed, w, 1e-5)
            ops.fused_add_rms_norm(x, residual, w, 1e-5)
            assert torch.equal(residual, summed), f"fused_add_rms_norm residual {dtype} {shape}"
            close(x, expected, dtype, f"fused_add_rms_norm {dtype} {shape}")


@pytest.mark.cuda
@needs_cuda
def test_rotary_embedding_neox_and_gptj_full_and_partial():
    gen = torch.Generator("cuda").manual_seed(2)
    tokens, max_pos = 37, 4096
    positions = torch.randint(0, max_pos, (tokens,), generator=gen, device="cuda")
    for dtype in DTYPES:
        for head_size in (64, 128, 256):
            for rot_dim in (head_size, head_size // 2):
                for is_neox in (True, False):
                    for cache_dtype in {torch.float32, dtype}:
                        inv = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device="cuda").float() / rot_dim)
                        freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv[None]
                        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(cache_dtype)
                        # q and k as views of a fused qkv projection (8 q heads, 2 k heads, 2 v heads)
                        qkv = torch.randn(tokens, 12 * head_size, generator=gen, device="cuda").to(dtype)
                        q = qkv[:, : 8 * head_size]
                        k = qkv[:, 8 * head_size: 10 * head_size].view(tokens, 2, head_size)
                        v_before = qkv[:, 10 * head_size:].clone()
                        q_ref = rotary_reference(positions, q.view(tokens, 8, head_size), cache, is_neox)
                        k_ref = rotary_reference(positions, k, cache, is_neox)
                        ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
                        what = f"rotary {dtype} D={head_size} rot={rot_dim} neox={is_neox} cache={cache_dtype}"
                        close(q.view(tokens, 8, head_size), q_ref, dtype, what + " q")
                        close(k, k_ref, dtype, what + " k")
                        assert torch.equal(qkv[:, 10 * head_size:], v_before), what + ": v was written"
    # no key
    q = torch.randn(tokens, 4, 64, generator=gen, device="cuda")
    cache = torch.randn(max_pos, 64, generator=gen, device="cuda")
    expected = rotary_reference(positions, q, cache, True)
    ops.rotary_embedding(positions, q, None, 64, cache, True)
    close(q, expected, torch.float32, "rotary without key")


@pytest.mark.cuda
@needs_cuda
def test_rotary_embedding_matches_the_layer_with_llama3_scaling():
    # The layer tabulates cos and sin (with Llama 3's frequency scaling); cat(cos, sin) is the
    # kernel's cache, so the scaling needs nothing from the kernel.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    for dtype in DTYPES:
        with torch.device("cuda"):
            rotary = RotaryEmbedding(128, 16384, 500000.0, scaling)
        gen = torch.Generator("cuda").manual_seed(3)
        positions = torch.randint(0, 16384, (19,), generator=gen, device="cuda")
        q = torch.randn(19, 32, 128, generator=gen, device="cuda").to(dtype)
        k = torch.randn(19, 8, 128, generator=gen, device="cuda").to(dtype)
        # the layer's own PyTorch rotation (forward may route to a kernel)
        cos = rotary.cos[positions].unsqueeze(1).to(dtype)
        sin = rotary.sin[positions].unsqueeze(1).to(dtype)
        q_ref, k_ref = RotaryEmbedding._rotate(q, cos, sin), RotaryEmbedding._rotate(k, cos, sin)
        cache = torch.cat((rotary.cos, rotary.sin), dim=-1)
        ops.rotary_embedding(positions, q, k, 128, cache, True)
        # The layer rounds cos, sin and each product to the dtype, the kernel only the result:
        # up to about two ulps apart, hence twice the usual tolerance.
        tol = 2 * TOL[dtype]
        for actual, expected in ((q, q_ref), (k, k_ref)):
            torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.cuda
@needs_cuda
def test_silu_and_mul():
    gen = torch.Generator("cuda").manual_seed(4)
    for dtype in DTYPES:
        for shape in ((5, 2 * 14336), (3, 2 * 1001), (2, 3, 2 * 256), (1, 2 * 8)):
            x = (torch.randn(shape, generator=gen, device="cuda") * 3).to(dtype)
            out = torch.empty(*shape[:-1], shape[-1] // 2, device="cuda", dtype=dtype)
            ops.silu_and_mul(out, x)
            d = shape[-1] // 2
            expected = F.silu(x[..., :d]) * x[..., d:]  # activation.py, in the dtype
            close(out, expected, dtype, f"silu_and_mul {dtype} {shape}")


@pytest.mark.cuda
@needs_cuda
def test_cuda_matches_cpu_twins():
    # The same float32 data through the CUDA kernels and their CPU twins (csrc/cpu/fused.cpp).
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 1024, generator=gen)
    residual = torch.randn(9, 1024, generator=gen)
    w = 1 + 0.1 * torch.randn(1024, generator=gen)
    table = torch.randn(1024, 128, generator=gen)
    outs = {}
    for device in ("cpu", "cuda"):
        xd, rd, wd = x.to(device), residual.to(device), w.to(device)
        normed = torch.empty_like(xd)
        ops.rms_norm(normed, xd, wd, 1e-6)
        ops.fused_add_rms_norm(xd, rd, wd, 1e-6)
        positions = torch.arange(9, device=device) * 97
        cache = table.to(device)
        q, k = xd.clone().view(9, 8, 128), rd.clone().view(9, 8, 128)
        ops.rotary_embedding(positions, q, k, 128, cache, True)
        act = torch.empty(9, 512, device=device)
        ops.silu_and_mul(act, xd)
        outs[device] = [t.cpu() for t in (normed, xd, rd, q, k, act)]
    for name, cpu, gpu in zip(("rms_norm", "fused normed", "fused residual", "rotary q", "rotary k",
                               "silu_and_mul"), outs["cpu"], outs["cuda"]):
        torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
