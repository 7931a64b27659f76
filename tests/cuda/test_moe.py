"""The mixture-of-experts steps on CUDA (csrc/cuda/moe.cu) against their CPU twins: the same
row order, the same float32 sums bitwise; the block's CUDA path (a GEMM per expert over
sorted rows) against the CPU's loop over experts, float32 and bfloat16. Issue 56."""

import pytest
import torch

from pyserve import _native

CUDA = torch.cuda.is_available() and _native.built_with_cuda()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build")


def _routing(tokens, experts, k, seed):
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=gen), -1), k, dim=-1)
    return weights.contiguous(), ids.contiguous(), gen


@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (37, 128, 8), (512, 60, 4), (5, 4, 4)])
def test_sort_rows_and_combine_equal_the_cpu_twins(tokens, experts, k):
    weights, ids, gen = _routing(tokens, experts, k, tokens)
    rows_cpu, offsets_cpu = _native.moe_sort_rows(ids, experts)
    rows_gpu, offsets_gpu = _native.moe_sort_rows(ids.cuda(), experts)
    assert torch.equal(rows_gpu.cpu(), rows_cpu) and torch.equal(offsets_gpu.cpu(), offsets_cpu)
    y = torch.randn(tokens * k, 256, generator=gen)
    out_cpu, out_gpu = torch.empty(tokens, 256), torch.empty(tokens, 256, device="cuda")
    _native.moe_combine(out_cpu, y, rows_cpu, ids, weights)
    _native.moe_combine(out_gpu, y.cuda(), rows_gpu, ids.cuda(), weights.cuda())
    assert torch.equal(out_gpu.cpu().view(torch.int32), out_cpu.view(torch.int32))


def test_bad_expert_ids_are_refused():
    with pytest.raises(RuntimeError, match="expert id"):
        _native.moe_sort_rows(torch.tensor([[0, 9]], device="cuda"), 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_the_block_on_cuda_equals_the_cpu_loop(dtype, tol):
    from pyserve.model.layers.moe import MoeSpec, SparseMoe

    torch.manual_seed(0)
    cpu = SparseMoe(256, MoeSpec(16, 4, 128, True, (True,)), torch.float32)
    with torch.no_grad():
        for param in cpu.parameters():
            param.normal_(0.0, 0.05)
    gpu = SparseMoe(256, MoeSpec(16, 4, 128, True, (True,)), dtype).cuda()
    gpu.load_state_dict({k: v.to(dtype) for k, v in cpu.state_dict().items()})
    x = torch.randn(40, 256)
    weights, ids = cpu.route(x)  # one routing for both: bfloat16 logits could pick others
    reference = cpu._experts_loop(x, weights, ids)
    out = gpu.experts_sorted(x.to(dtype).cuda(), weights.to(dtype).cuda(), ids.cuda()).float().cpu()
    assert (out - reference).abs().max() <= tol * reference.abs().max()
    if dtype == torch.float32:  # and the whole block, routing included
        whole = gpu(x.cuda()).cpu()
        assert (whole - cpu(x)).abs().max() <= tol * reference.abs().max()
