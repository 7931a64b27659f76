"""The shared-memory communicator against plain PyTorch: two ranks as two threads of this
process (every collective releases the GIL), slots small enough to force chunking."""

import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pyserve import _native

SLOT = 4096  # bytes: the tensors below go through in several chunks


def make_pair(world: int = 2, slot: int = SLOT):
    name = f"/pyserve-test-{os.getpid()}-{secrets.token_hex(4)}"
    comms = [_native.ShmCommunicator(name, 0, world, slot, create=True)]
    comms += [_native.ShmCommunicator(name, r, world, slot, create=False) for r in range(1, world)]
    return comms


def on_all_ranks(comms, fn):
    with ThreadPoolExecutor(len(comms)) as pool:
        return list(pool.map(fn, comms))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_reduce_sums_in_rank_order_on_every_rank(dtype):
    comms = make_pair(world=3)
    inputs = [torch.randn(5000, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(3)]

    def run(comm):
        t = inputs[comm.rank].clone()
        comm.all_reduce(t)
        return t

    results = on_all_ranks(comms, run)
    expected = ((inputs[0].float() + inputs[1].float()) + inputs[2].float()).to(dtype)
    for r in results:
        assert torch.equal(r, expected)  # bitwise: same order, float accumulation


def test_all_gather_gather_and_broadcast():
    comms = make_pair()
    data = [torch.arange(3000, dtype=torch.int64) * (r + 1) for r in range(2)]

    def run(comm):
        everyone = comm.all_gather(data[comm.rank])
        at_root = comm.gather(data[comm.rank], 0)
        sent = data[0].clone() if comm.rank == 0 else torch.zeros(3000, dtype=torch.int64)
        comm.broadcast(sent, 0)
        return everyone, at_root, sent

    (all0, root0, b0), (all1, root1, b1) = on_all_ranks(comms, run)
    stacked = torch.stack(data)
    assert torch.equal(all0, stacked) and torch.equal(all1, stacked)
    assert torch.equal(root0, stacked) and root1.numel() == 0
    assert torch.equal(b0, data[0]) and torch.equal(b1, data[0])


def test_empty_tensors_still_meet_the_other_ranks():
    comms = make_pair()

    def run(comm):
        comm.all_reduce(torch.empty(0))
        t = torch.tensor([float(comm.rank + 1)])
        comm.all_reduce(t)
        return t.item()

    assert on_all_ranks(comms, run) == [3.0, 3.0]


def test_abort_wakes_a_rank_waiting_for_a_peer_that_never_comes():
    comm0, comm1 = make_pair()
    errors = []

    def wait_alone():
        try:
            comm0.barrier()
        except RuntimeError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=wait_alone)
    waiter.start()
    time.sleep(0.3)  # long past the spin phase: it sleeps on the futex
    start = time.monotonic()
    comm1.abort()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - start < 1.0
    assert errors and "aborted" in errors[0]
    with pytest.raises(RuntimeError, match="aborted"):
        comm1.barrier()


def test_segment_name_is_gone_after_unlink_and_attaching_then_fails():
    comm0, comm1 = make_pair()
    path = "/dev/shm" + comm0.name
    assert os.path.exists(path)
    comm0.unlink()
    assert not os.path.exists(path)
    t = torch.ones(10)
    on_all_ranks([comm0, comm1], lambda c: c.all_reduce(t.clone()))  # mappings still work
    with pytest.raises(RuntimeError, match="shm_open"):
        _native.ShmCommunicator(comm0.name, 1, 2, SLOT, create=False)


def test_attaching_with_another_shape_is_refused():
    comm0, _ = make_pair()
    with pytest.raises(RuntimeError, match="wrong size|does not match"):
        _native.ShmCommunicator(comm0.name, 1, 3, SLOT, create=False)


def test_non_contiguous_or_wrong_device_tensors_are_refused():
    (comm,) = make_pair(world=1)
    with pytest.raises(RuntimeError, match="contiguous"):
        comm.all_reduce(torch.zeros(4, 4).t())


def test_broadcast_tensors_carries_sizes_the_receivers_do_not_know():
    comms = make_pair(world=3)
    sent = [torch.arange(2000, dtype=torch.int64), torch.empty(0, dtype=torch.int32),
            torch.tensor([1.5, -2.0])]

    def run(comm):
        return comm.broadcast_tensors(sent if comm.rank == 0 else [], 0)

    for received in on_all_ranks(comms, run):  # 16 KB through a 4 KB slot
        assert [t.dtype for t in received] == [torch.uint8] * 3
        for a, b in zip(sent, received):
            assert torch.equal(a.view(torch.uint8), b)
