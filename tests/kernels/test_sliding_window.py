"""Sliding-window and softcapped paged attention (Gemma's local layers, Gemma 2's scores)
against plain PyTorch: windows crossing block boundaries, prefill chunks straddling the
window, decode rows far past it, and local and global attention over one batch."""

import pytest
import torch

from pyserve import _native

from .test_attention import TOL, make_batch


def reference(query, keys, values, q_len, scale, window=0, softcap=0.0):
    """query [q, H, D] (the last q tokens), keys/values [ctx, Hkv, D] -> [q, H, D]; the row at
    position p sees keys (p - window, p] (every key up to p when window <= 0)."""
    ctx, group = keys.shape[0], query.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    key = torch.arange(ctx)[None, :]
    hidden = key > pos
    if window > 0:
        hidden |= key <= pos - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# (context_len, query_len): decode rows past the window and on block edges, whole prompts and
# chunks that start before, on and after the window's edge
SPECS = [(1, 1), (9, 1), (17, 1), (33, 1), (100, 1), (40, 40), (50, 20), (70, 3), (24, 16),
         (129, 17)]


def run(specs, head_size, num_kv_heads, group, block_size, dtype, window, softcap=0.0, seed=0):
    kc, vc, tables, kv = make_batch(specs, num_kv_heads, head_size, block_size, dtype, seed=seed)
    query = torch.randn(sum(q for _, q in specs), num_kv_heads * group, head_size,
                        generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    starts = torch.tensor([0] + [sum(q for _, q in specs[: i + 1]) for i in range(len(specs))],
                          dtype=torch.int32)
    lens = torch.tensor([c for c, _ in specs], dtype=torch.int32)
    scale = head_size ** -0.5
    out = torch.empty_like(query)
    _native.paged_attention(out, query, kc, vc, tables, starts, lens, scale, window, softcap)
    expected = [reference(query[starts[i]:starts[i + 1]], *kv[i], q, scale, window, softcap)
                for i, (_, q) in enumerate(specs)]
    return out, torch.cat(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 256, 48])  # SIMD and 16-row tile paths; the plain loop
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 4), (1, 8)])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_sliding_window_matches_reference(dtype, block_size, head_size, num_kv_heads, group, window):
    out, expected = run(SPECS, head_size, num_kv_heads, group, block_size, dtype, window,
                        seed=window + group)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_size", [64, 128, 48])
@pytest.mark.parametrize("window", [0, 8])
def test_softcapped_scores_match_reference(head_size, window):
    """Scores spread wide enough (x 8) that tanh bends them: the cap changes the output."""
    specs = [(30, 30), (45, 1), (64, 10)]
    kc, vc, tables, kv = make_batch(specs, 2, head_size, 16, torch.float32, seed=11)
    query = torch.randn(41, 4, head_size, generator=torch.Generator().manual_seed(12)) * 8
    starts = torch.tensor([0, 30, 31, 41], dtype=torch.int32)
    lens = torch.tensor([30, 45, 64], dtype=torch.int32)
    scale, cap = head_size ** -0.5, 5.0
    out = torch.empty_like(query)
    _native.paged_attention(out, query, kc, vc, tables, starts, lens, scale, window, cap)
    expected = torch.cat([reference(query[starts[i]:starts[i + 1]], *kv[i], q, scale, window, cap)
                          for i, (_, q) in enumerate(specs)])
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    uncapped = torch.cat([reference(query[starts[i]:starts[i + 1]], *kv[i], q, scale, window)
                          for i, (_, q) in enumerate(specs)])
    assert (uncapped - expected).abs().max() > 1e-2


def test_local_and_global_layers_share_one_batch():
    """One step's metadata and cache serve a local layer and a global one: each call's window
    is its own, a window covering the whole context is global attention exactly, and the
    default is global."""
    specs = [(50, 20), (33, 1), (16, 16)]
    kc, vc, tables, kv = make_batch(specs, 2, 64, 16, torch.float32, seed=4)
    query = torch.randn(37, 4, 64, generator=torch.Generator().manual_seed(5))
    starts = torch.tensor([0, 20, 21, 37], dtype=torch.int32)
    lens = torch.tensor([50, 33, 16], dtype=torch.int32)
    outs = {}
    for name, window in (("local", 8), ("global", 0), ("wide", 50), ("default", None)):
        out = torch.empty_like(query)
        args = (out, query, kc, vc, tables, starts, lens, 0.125)
        _native.paged_attention(*args) if window is None else _native.paged_attention(*args, window)
        outs[name] = out
    for i, (_, q) in enumerate(specs):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        torch.testing.assert_close(outs["local"][rows], reference(query[rows], *kv[i], q, 0.125, 8),
                                   atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(outs["global"][rows], reference(query[rows], *kv[i], q, 0.125),
                                   atol=2e-5, rtol=2e-5)
    assert torch.equal(outs["wide"], outs["global"]) and torch.equal(outs["default"], outs["global"])
    assert (outs["local"] - outs["global"]).abs().max() > 1e-2
