"""Which communicator the ranks of a Ray-placed group reduce through, and connecting to it: the
same code on rank 0 (the server process) and in every Ray actor.

    shm:  every rank on one node: pyserve._C's shared-memory communicator, as the multiprocess
          executor uses (rank 0 creates the segment, the others attach, rank 0 unlinks it
          once all have: nothing is left in /dev/shm however the ranks end)
    gloo: ranks on several nodes (or forced with --ray-collectives gloo): torch.distributed's
          gloo over TCP (gloo_communicator.py)

CUDA (not built): the model's collectives would go through _native.NcclCommunicator, its
unique id made by rank 0 (_native.nccl_unique_id()) and handed to the actors inside
Collectives, as the multiprocess executor hands it to its workers; the step channel would stay
on shm or gloo."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve import _native
from pyserve.executor.gloo_communicator import GlooCommunicator, GlooRendezvous

def choose_collectives(node_ids: list[str], requested: str) -> str:
    """node_ids: each rank's node, in rank order."""
    if requested == "gloo" or len(set(node_ids)) > 1:
        return "gloo"
    return "shm"


@dataclass(frozen=True)
class Collectives:
    """Plain data: what every rank needs to join the group's communicator."""

    kind: str  # "shm" or "gloo"
    world_size: int
    shm_name: str = ""
    slot_bytes: int = 0
    rendezvous: GlooRendezvous | None = None


def connect(plan: Collectives, rank: int, own_host: str, store=None):
    """The rank's communicator: attached (shm, a barrier then follows) or joined (gloo: returns
    once every rank has joined). Rank 0 creates the shm segment, or passes its gloo store."""
    if plan.kind == "shm":
        return _native.ShmCommunicator(plan.shm_name, rank, plan.world_size, plan.slot_bytes,
                                       create=rank == 0)
    return GlooCommunicator(plan.rendezvous, rank, plan.world_size, own_host, store)
