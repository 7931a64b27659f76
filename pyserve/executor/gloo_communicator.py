"""torch.distributed's gloo behind the communicator interface that the layers' TPGroup and the
step channel call (all_reduce, gather, all_gather, broadcast_tensors, barrier, abort, aborted)
and a pipeline hop's two-rank broadcast: the collectives of ranks on different machines, over
TCP, on the CPU.

One gloo process group per communicator, built directly (no torch.distributed default group,
so nothing global): rank 0 runs the TCPStore that the ranks rendezvous through, on its node's
address and a port the system picks; the ranks learn both from rank 0 at start-up (through
Ray). Each rank binds gloo's transport to its own node's address, not whatever its hostname
resolves to.

broadcast_tensors keeps step_channel.py's message: a fixed-size int64 header [count, byte size
of each] from the root, then every tensor's raw bytes in one uint8 buffer; receivers get the
uint8 pieces back, as from the shared-memory communicator.

Timeouts. A rank waiting for rank 0's next step (the header) waits as long as the server is
idle, so the group's timeout is IDLE_TIMEOUT; collectives inside a step wait for peers that are
in the same step, so they carry COLLECTIVE_TIMEOUT, the backstop for a peer whose machine
vanished without closing its sockets. A peer process that dies closes its sockets, and any
collective waiting on it raises at once (gloo: "Connection closed by peer"). gloo cannot cancel
a collective already waiting, so abort() only makes later calls raise; the executor ends
collectives in flight by killing the peers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import (AllreduceOptions, BroadcastOptions, GatherOptions, PrefixStore,
                               ProcessGroupGloo, TCPStore)

IDLE_TIMEOUT = timedelta(days=365)
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# every rank connects to the store within this (start-up: the actors are already running)
RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
MAX_BROADCAST_TENSORS = 15


@dataclass(frozen=True)
class GlooRendezvous:
    """Where the ranks meet: rank 0's node address and its TCPStore's port. Plain data, handed
    to the other ranks at start-up."""

    host: str
    port: int


def host_store(host: str, world_size: int) -> TCPStore:
    """Rank 0's store, on a free port of host (store.port says which)."""
    return TCPStore(host, 0, world_size, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False)


def join_store(rendezvous: GlooRendezvous, world_size: int) -> TCPStore:
    """Another rank's connection to rank 0's store; one serves all the rank's groups."""
    return TCPStore(rendezvous.host, rendezvous.port, world_size, False, timeout=RENDEZVOUS_TIMEOUT)


class GlooCommunicator:
    def __init__(self, rendezvous: GlooRendezvous, rank: int, world_size: int, own_host: str,
                 store: TCPStore | None = None, prefix: str = ""):
        """store: rank 0's host_store(), or a join_store(); None: this joins rendezvous.
        prefix: the group's own keys in the store, where several groups share it (pipeline
        parallelism's stage and hop groups); rank and world_size are then the group's.
        Returns once every rank of the group has joined."""
        if store is None:
            store = join_store(rendezvous, world_size)
        self._store = store  # rank 0's must outlive the group
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname=own_host)]
        options._timeout = IDLE_TIMEOUT
        self._group = ProcessGroupGloo(PrefixStore(prefix, store) if prefix else store, rank,
                                       world_size, options)
        self.rank, self.world_size = rank, world_size
        self._aborted = False

    @property
    def aborted(self) -> bool:
        return self._aborted

    def abort(self) -> None:
        self._aborted = True

    def _check(self) -> None:
        if self._aborted:
            raise RuntimeError("the gloo communicator was aborted")

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums tensor over the ranks, in place."""
        self._check()
        options = AllreduceOptions()
        options.timeout = COLLECTIVE_TIMEOUT
        self._group.allreduce([tensor], options).wait()

    def gather(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Root: [world_size, *tensor.shape] in rank order; other ranks: tensor itself."""
        self._check()
        options = GatherOptions()
        options.rootRank, options.timeout = root, COLLECTIVE_TIMEOUT
        parts = ([[torch.empty_like(tensor) for _ in range(self.world_size)]]
                 if self.rank == root else [])
        self._group.gather(parts, [tensor], options).wait()
        return torch.stack(parts[0]) if self.rank == root else tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[world_size, *tensor.shape] on every rank."""
        self._check()
        parts = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
        self._group.allgather(parts, [tensor]).wait(COLLECTIVE_TIMEOUT)
        return torch.stack(parts[0])

    def broadcast_tensors(self, tensors: list[torch.Tensor], root: int = 0) -> list[torch.Tensor]:
        """Root sends tensors (contiguous, on the CPU); every rank gets their bytes, as uint8."""
        self._check()
        header = torch.zeros(1 + MAX_BROADCAST_TENSORS, dtype=torch.int64)
        if self.rank == root:
            if len(tensors) > MAX_BROADCAST_TENSORS:
                raise ValueError(f"broadcast_tensors: at most {MAX_BROADCAST_TENSORS} tensors")
            pieces = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
            header[0] = len(pieces)
            header[1:1 + len(pieces)] = torch.tensor([p.numel() for p in pieces], dtype=torch.int64)
        self._broadcast(header, root, IDLE_TIMEOUT)  # receivers wait here between steps
        count = int(header[0])
        sizes = header[1:1 + count].tolist()
        if self.rank == root:
            body = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        else:
            body = torch.empty(sum(sizes), dtype=torch.uint8)
        if body.numel():
            self._broadcast(body, root, COLLECTIVE_TIMEOUT)
        return list(body.split(sizes)) if count else []

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """tensor (contiguous) from root to every rank, in place: a pipeline hop's send and
        receive, which pair up inside one step."""
        self._broadcast(tensor, root, COLLECTIVE_TIMEOUT)

    def _broadcast(self, tensor: torch.Tensor, root: int, timeout: timedelta) -> None:
        self._check()
        options = BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = root, 0, timeout
        self._group.broadcast([tensor], options).wait()

    def barrier(self) -> None:
        """Every rank has reached it; waits as long as the slowest rank's start-up."""
        self._check()
        options = AllreduceOptions()
        options.timeout = IDLE_TIMEOUT
        self._group.allreduce([torch.zeros(1)], options).wait()
