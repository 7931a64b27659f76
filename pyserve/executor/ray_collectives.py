"""Which communicators the ranks of a Ray-placed world use, and connecting to them: the same
code on rank 0 (the server process) and in every Ray actor.

Each communicator is one of
    shm:  its ranks all on one node: pyserve._C's shared-memory communicator, as the
          multiprocess executor uses (one rank creates the segment, the others attach, the
          creator unlinks it once all have: nothing is left in /dev/shm however the ranks end)
    gloo: its ranks on several nodes (or every communicator, with --ray-collectives gloo):
          torch.distributed's gloo over TCP (gloo_communicator.py); all the world's gloo
          groups meet in rank 0's one TCPStore, each under its own key prefix
The world communicator carries the step channel (and, without pipeline parallelism, the
layers' all-reduces). Under pipeline parallelism each stage's TP group, each hop between
stages and the logits back to rank 0 are communicators of their own (pipeline.py's segments),
each chosen by where its own ranks are: a stage on one node reduces through shared memory
while its hop to a stage on another node goes over gloo.

CUDA (not built): the model's collectives would go through _native.NcclCommunicator, its
unique id made by rank 0 (_native.nccl_unique_id()) and handed to the actors inside
Collectives, as the multiprocess executor hands it to its workers; the step channel would stay
on shm or gloo."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve import _native
from pyserve.executor.gloo_communicator import GlooCommunicator, GlooRendezvous, join_store
from pyserve.executor.pipeline import PipelineLayout, StageLinks, links_over


def choose_collectives(node_ids: list[str], requested: str) -> str:
    """node_ids: the nodes of a communicator's ranks."""
    if requested == "gloo" or len(set(node_ids)) > 1:
        return "gloo"
    return "shm"


def segment_kinds(layout: PipelineLayout, node_ids: list[str], requested: str) -> dict[str, str]:
    """Each pipeline segment's communicator kind, from its own ranks' nodes (node_ids: every
    rank's, in rank order)."""
    return {name: choose_collectives([node_ids[r] for r in layout.members(name)], requested)
            for name in layout.segments()}


@dataclass(frozen=True)
class Collectives:
    """Plain data: what every rank needs to join the world's communicators."""

    kind: str  # the world communicator's: "shm" or "gloo"
    world_size: int
    shm_name: str = ""
    slot_bytes: int = 0
    rendezvous: GlooRendezvous | None = None  # rank 0's store: any communicator over gloo
    pipeline: PipelineLayout | None = None  # pipeline parallelism's segments
    segments: tuple[tuple[str, str], ...] = ()  # each segment's (name, kind)


def connect(plan: Collectives, rank: int, own_host: str, store=None):
    """The rank's world communicator: attached (shm, a barrier then follows) or joined (gloo:
    returns once every rank has joined). Rank 0 creates the shm segment; store is rank 0's
    gloo store, or this rank's connection to it."""
    if plan.kind == "shm":
        return _native.ShmCommunicator(plan.shm_name, rank, plan.world_size, plan.slot_bytes,
                                       create=rank == 0)
    return GlooCommunicator(plan.rendezvous, rank, plan.world_size, own_host, store)


def rank_store(plan: Collectives, rank: int, store=None):
    """The gloo store this rank's groups meet in: rank 0's own (store), or a connection to it;
    None when nothing goes over gloo."""
    if plan.rendezvous is None or rank == 0:
        return store
    return join_store(plan.rendezvous, plan.world_size)


def connect_links(plan: Collectives, rank: int, own_host: str, world, store,
                  held: list | None = None) -> StageLinks:
    """The rank's pipeline segments, after the world communicator is up; held (rank 0's list
    of communicators to abort) gets each the moment it exists. Every rank walks the segments
    in one order. Shared memory first: the creators create, a world barrier, the others
    attach, a second barrier, and the creators unlink the names, so that no name outlives
    those few steps, however the ranks end later. Then the gloo joins: each gloo group forms
    once all its ranks reach it, and the one order means the lowest unformed group always
    has all its ranks coming."""
    layout, kinds = plan.pipeline, dict(plan.segments)
    member = layout.memberships(rank)
    order = [name for name in layout.segments() if name in member]
    held = [] if held is None else held
    comms = {}

    def shm(name: str, create: bool):
        size, index = member[name]
        comms[name] = _native.ShmCommunicator(name, index, size, layout.slot_bytes, create=create)
        held.append(comms[name])
        return comms[name]

    created = [shm(name, True) for name in order if kinds[name] == "shm" and member[name][1] == 0]
    world.barrier()  # every segment exists
    for name in order:
        if kinds[name] == "shm" and member[name][1] != 0:
            shm(name, False)
    world.barrier()  # every rank attached
    for comm in created:
        comm.unlink()
    for name in order:
        if kinds[name] == "gloo":
            size, index = member[name]
            comms[name] = GlooCommunicator(plan.rendezvous, index, size, own_host, store, prefix=name)
            held.append(comms[name])
    return links_over(layout, rank, {name: comms[name] for name in order})
