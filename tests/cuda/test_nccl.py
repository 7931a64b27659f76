"""The NCCL communicator on one GPU: created from a fresh unique id, a one-rank all-reduce,
all-gather and broadcast, and the all-reduce captured in a CUDA graph and replayed (what the
tensor-parallel layers need on CUDA). Several ranks need several GPUs; the CPU tests cover the
multi-rank logic with the shared-memory communicator."""

import pytest
import torch

from pyserve import _native

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not (torch.cuda.is_available() and _native.NcclCommunicator is not None),
                       reason="needs a CUDA device and a CUDA build of pyserve._C with NCCL"),
]


def test_one_rank_collectives_and_all_reduce_in_a_captured_graph():
    torch.cuda.set_device(0)
    comm = _native.NcclCommunicator(_native.nccl_unique_id(), 0, 1)
    x = torch.arange(1024, dtype=torch.float32, device="cuda")
    expected = x.clone()
    comm.all_reduce(x)
    torch.cuda.synchronize()
    assert torch.equal(x, expected)  # a sum over one rank
    gathered = comm.all_gather(x)
    assert gathered.shape == (1, 1024) and torch.equal(gathered[0], expected)
    comm.broadcast(x, 0)
    assert torch.equal(x, expected)

    static = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the default stream before capture
        comm.all_reduce(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.mul_(2)
        comm.all_reduce(static)
    for value in (1.0, 3.0):
        static.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(static == 2 * value)
