"""The fused mixture-of-experts call (csrc/cpu/moe.cpp, grouped_linear in csrc/cpu/linear.cpp)
against two references: a plain loop over experts of the packed kernels themselves
(packed_linear, silu_and_mul, index_add_ in ascending expert order: bitwise, since each row's
product does not depend on the rows beside it), and a float64 loop over the dequantized
weights (float32 accumulation error). Every GGUF type the kernels read, float32 and bfloat16
weights, both activation modes; an expert no row picks, one every row picks, top-k equal to
the number of experts, one row and 512 rows."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyserve import _native

from .test_kquant import LAYOUT, gguf_dequantized, random_blocks

QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
H, I = 256, 512  # hidden and expert sizes: multiples of the K-quants' 256


def expert_weights(kind: str, rows: int, cols: int, experts: int, seed: int):
    """[(raw blocks or None, float32 [rows, cols])] per expert: the blocks of `kind` and
    their dequantized weight, or a float weight (float32 / bfloat16-valued)."""
    out = []
    for e in range(experts):
        if kind in LAYOUT:
            blocks = random_blocks(kind, rows, cols, seed=seed + e)
            out.append((blocks, gguf_dequantized(kind, blocks, rows, cols)))
        elif kind in ("Q4_1", "Q8_0"):
            from gguf import GGMLQuantizationType
            from gguf.quants import quantize

            weight = np.random.default_rng(seed + e).normal(0, 0.05, (rows, cols)).astype(np.float32)
            blocks = quantize(weight, GGMLQuantizationType[kind])
            out.append((blocks, gguf_dequantized(kind, blocks, rows, cols)))
        else:
            weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed + e)) * 0.05
            if kind == "bfloat16":
                weight = weight.bfloat16().float()
            out.append((None, weight))
    return out


def pack(kind: str, blocks, weight: torch.Tensor, int8: bool) -> torch.Tensor:
    if blocks is None:
        return _native.pack_linear_weight(weight.bfloat16() if kind == "bfloat16" else weight)
    return _native.pack_gguf_weight(torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1], kind,
                                    int8_activations=int8)


def make_experts(kind: str, experts: int, int8: bool = False, down_kind: str | None = None):
    """(gate_up stacks, down stack, float gate_up [E, 2I, H], float down [E, H, I])"""
    gate = expert_weights(kind, I, H, experts, seed=11)
    up = expert_weights(kind, I, H, experts, seed=101)
    down = expert_weights(down_kind or kind, H, I, experts, seed=211)
    gate_up = torch.stack([
        pack(kind, None if g[0] is None else np.concatenate([g[0], u[0]]), torch.cat([g[1], u[1]]), int8)
        for g, u in zip(gate, up)])
    down_packed = torch.stack([pack(down_kind or kind, d[0], d[1], int8) for d in down])
    dense_gate_up = torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up)])
    return [gate_up], down_packed, dense_gate_up, torch.stack([d[1] for d in down])


def loop_reference(x, ids, weights, gate_up, down):
    """The packed kernels, one expert at a time, in ascending expert order."""
    out = torch.zeros_like(x)
    for e in sorted(set(ids.flatten().tolist())):
        token, choice = torch.where(ids == e)
        rows = x[token].contiguous()
        parts = []
        for stack in gate_up:
            h = x.new_empty(rows.shape[0], _packed_rows(stack[e]))
            _native.packed_linear(h, rows, stack[e], None)
            parts.append(h)
        h = torch.cat(parts, dim=1).contiguous()
        act = h.new_empty(h.shape[0], h.shape[1] // 2)
        _native.silu_and_mul(act, h)
        y = x.new_empty(rows.shape[0], x.shape[1])
        _native.packed_linear(y, act, down[e], None)
        out.index_add_(0, token, y * weights[token, choice, None])
    return out


def _packed_rows(packed):
    return packed.shape[0] * 32  # every test shape fills its panels


def float64_reference(x, ids, weights, gate_up, down):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = ids[t, c].item()
            h = x[t].double() @ gate_up[e].double().T
            act = F.silu(h[:I]) * h[I:]
            out[t] += weights[t, c].double() * (act @ down[e].double().T)
    return out


def routing(tokens: int, experts: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    return weights.contiguous(), ids.contiguous(), gen


def fused(x, ids, weights, gate_up, down, **kw):
    out = torch.empty_like(x)
    _native.fused_moe(out, x, ids, weights, gate_up, down, **kw)
    return out


def bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", QUANT + ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 7, 512])
def test_fused_equals_the_loop_bitwise_and_float64_closely(kind, tokens):
    experts, k = 6, 2
    gate_up, down, dense_gate_up, dense_down = make_experts(kind, experts)
    weights, ids, gen = routing(tokens, experts, k, seed=tokens)
    x = torch.randn(tokens, H, generator=gen)
    out = fused(x, ids, weights, gate_up, down)
    assert torch.equal(bits(out), bits(loop_reference(x, ids, weights, gate_up, down)))
    if tokens <= 7:
        reference = float64_reference(x, ids, weights, dense_gate_up, dense_down)
        # float32 accumulation over K = 256 and 512 products: within 1e-5 of the output's scale
        assert (out.double() - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("kind", [t for t in QUANT if t != "Q6_K"] + ["Q6_K"])
def test_int8_activations_equal_the_int8_loop_bitwise(kind):
    if not _native.int8_dot_supported():
        pytest.skip("this build has no int8 dot-product kernel (needs AVX2 or AVX-512 VNNI)")
    experts, k, tokens = 5, 3, 40
    gate_up, down, dense_gate_up, dense_down = make_experts(kind, experts, int8=True)
    weights, ids, gen = routing(tokens, experts, k, seed=3)
    x = torch.randn(tokens, H, generator=gen)
    out = fused(x, ids, weights, gate_up, down)
    assert torch.equal(bits(out), bits(loop_reference(x, ids, weights, gate_up, down)))
    # int8 activations stay near the exact product (llama.cpp's arithmetic)
    exact = float64_reference(x, ids, weights, dense_gate_up, dense_down).float()
    assert (out - exact).norm() / exact.norm() < 0.05


def test_routing_edge_cases():
    """An expert no token picks, one every token picks, top-k equal to the number of
    experts, ties in the router's probabilities (torch.topk's choice, kept)."""
    experts = 4
    gate_up, down, *_ = make_experts("Q4_K", experts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, H, generator=gen)
    # expert 3 never picked, expert 0 picked by every token
    ids = torch.stack([torch.zeros(9, dtype=torch.long), torch.tensor([1, 2] * 4 + [1])], dim=1)
    weights = torch.rand(9, 2, generator=gen)
    assert torch.equal(bits(fused(x, ids, weights, gate_up, down)),
                       bits(loop_reference(x, ids, weights, gate_up, down)))
    # top-k = every expert
    weights, ids, _ = routing(9, experts, experts, seed=5)
    assert torch.equal(bits(fused(x, ids, weights, gate_up, down)),
                       bits(loop_reference(x, ids, weights, gate_up, down)))
    # ties: equal logits give equal probabilities; topk's ids are whatever it picked, and the
    # sum still runs in ascending expert order
    probs = torch.softmax(torch.zeros(9, experts), dim=-1)
    weights, ids = torch.topk(probs, 2, dim=-1)
    assert torch.equal(bits(fused(x, ids.contiguous(), weights.contiguous(), gate_up, down)),
                       bits(loop_reference(x, ids, weights, gate_up, down)))


def test_gate_and_up_in_different_types():
    """llama.cpp's mixes may store gate and up apart in different types: two stacks."""
    experts, tokens = 3, 5
    gate = expert_weights("Q4_K", I, H, experts, seed=1)
    up = expert_weights("Q6_K", I, H, experts, seed=2)
    down = expert_weights("Q5_K", H, I, experts, seed=3)
    stacks = [torch.stack([pack("Q4_K", b, w, False) for b, w in gate]),
              torch.stack([pack("Q6_K", b, w, False) for b, w in up])]
    down_packed = torch.stack([pack("Q5_K", b, w, False) for b, w in down])
    weights, ids, gen = routing(tokens, experts, 2, seed=9)
    x = torch.randn(tokens, H, generator=gen)
    out = fused(x, ids, weights, stacks, down_packed)
    assert torch.equal(bits(out), bits(loop_reference(x, ids, weights, stacks, down_packed)))


def test_clamped_swiglu_with_biases():
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU, as
    transformers' GptOssExperts computes them (gate and up as separate halves here)."""
    experts, tokens, alpha, limit = 4, 6, 1.702, 7.0
    _, _, dense_gate_up, dense_down = make_experts("float32", experts)
    dense_gate_up, dense_down = dense_gate_up * 40, dense_down * 40  # reach the clamp
    gate_up = [torch.stack([_native.pack_linear_weight(w) for w in dense_gate_up])]
    down = torch.stack([_native.pack_linear_weight(w) for w in dense_down])
    gen = torch.Generator().manual_seed(4)
    gate_up_bias, down_bias = torch.randn(experts, 2 * I, generator=gen), torch.randn(experts, H, generator=gen)
    weights, ids, _ = routing(tokens, experts, 2, seed=4)
    x = torch.randn(tokens, H, generator=gen)
    out = fused(x, ids, weights, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias,
                activation="swigluoai", alpha=alpha, limit=limit)
    reference = torch.zeros(tokens, H, dtype=torch.float64)
    for t in range(tokens):
        for c in range(2):
            e = ids[t, c].item()
            h = x[t].double() @ dense_gate_up[e].double().T + gate_up_bias[e].double()
            gate, up = h[:I].clamp(max=limit), h[I:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(gate * alpha)
            reference[t] += weights[t, c].double() * (act @ dense_down[e].double().T + down_bias[e].double())
    assert h[:I].max() > limit  # the clamp was reached
    torch.testing.assert_close(out.double(), reference, rtol=1e-4, atol=2e-3)


def test_bad_input_is_refused_by_name():
    gate_up, down, *_ = make_experts("Q8_0", 2)
    x = torch.randn(3, H)
    weights = torch.rand(3, 1)
    with pytest.raises(RuntimeError, match="expert id 2"):
        fused(x, torch.tensor([[0], [1], [2]]), weights, gate_up, down)
    with pytest.raises(RuntimeError, match="activation"):
        fused(x, torch.tensor([[0], [1], [1]]), weights, gate_up, down, activation="gelu")


def test_sort_rows_and_combine_as_the_loop_orders_them():
    """The two steps the CUDA path shares (moe_sort_rows, moe_combine): rows numbered by a
    counting sort (experts ascending, tokens in order), and the weighted sum bitwise the
    loop's index_add_ in ascending expert order."""
    experts, tokens, k = 7, 11, 3
    weights, ids, gen = routing(tokens, experts, k, seed=2)
    row_of, offsets = _native.moe_sort_rows(ids, experts)
    expected_rows, next_row = torch.empty_like(ids), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                torch.bincount(ids.flatten(), minlength=experts).cumsum(0)])
    assert torch.equal(offsets, next_row)
    next_row = next_row[:-1].clone()
    for i, e in enumerate(ids.flatten().tolist()):
        expected_rows.view(-1)[i] = next_row[e]
        next_row[e] += 1
    assert torch.equal(row_of, expected_rows)
    y = torch.randn(tokens * k, H, generator=gen)
    out = torch.empty(tokens, H)
    _native.moe_combine(out, y, row_of, ids, weights)
    reference = torch.zeros(tokens, H)
    for e in sorted(set(ids.flatten().tolist())):
        token, choice = torch.where(ids == e)
        reference.index_add_(0, token, y[row_of[token, choice]] * weights[token, choice, None])
    assert torch.equal(bits(out), bits(reference))


def test_the_sorted_path_equals_the_loop():
    """SparseMoe's CUDA path (a GEMM per expert over sorted rows), run on the CPU, against its
    loop over experts: the same products in other GEMM calls."""
    from pyserve.model.layers.moe import MoeSpec, SparseMoe

    torch.manual_seed(0)
    moe = SparseMoe(64, MoeSpec(6, 2, 32, True, (True,)), torch.float32)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(13, 64)
    weights, ids = moe.route(x)
    torch.testing.assert_close(moe.experts_sorted(x, weights, ids), moe._experts_loop(x, weights, ids),
                               rtol=1e-5, atol=1e-5)
