"""Pipeline parallelism's ranks, and the shared memory between them (the mp backend).

World: TP * PP ranks, numbered as vLLM numbers them: rank = stage * TP + tp_rank. Rank 0 (the
server process) is stage 0's tp rank 0, and the only rank that samples.

The segments (each a pyserve._C ShmCommunicator) are all created by rank 0 before any worker
starts, attached by the ranks that use them, and unlinked by rank 0 once every rank has
attached (the world barrier after attaching):

    world          every rank: the step channel (step_channel.py) and the start-up barriers
    tp s           stage s's TP ranks (TP > 1): the layers' all-reduces, the logits gather
    hop s.i        stage s's tp rank i -> stage s+1's tp rank i: the carried activations
    logits         the last stage's tp rank 0 -> rank 0: the logits of the step's logits rows

A hop is a point-to-point send over a two-rank communicator: the sender broadcasts from index
0, the receiver (index 1) into a buffer whose shape both sides know from the step ([n, T,
hidden_size] for n carried tensors of T tokens; [R, vocab] float32 for R logits rows). The
broadcast is a rendezvous: a send returns once the receiver has its copy. After its
all-reduce every tp rank of a stage holds the same activations, so each sends its own copy to
its counterpart and no stage re-broadcasts. Rank 0 keeps a handle on every segment, so that
its watchdog can abort them all: a rank blocked on any of them raises instead of hanging."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyserve import _native


@dataclass(frozen=True)
class PipelineLayout:
    """Plain, picklable data: it crosses to each worker process when it is spawned."""

    tp_size: int
    pp_size: int
    base_name: str  # the world segment's name; the others' derive from it
    slot_bytes: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def position(self, rank: int) -> tuple[int, int]:
        """-> (stage, tp rank)."""
        return divmod(rank, self.tp_size)

    def tp_name(self, stage: int) -> str:
        return f"{self.base_name}-tp{stage}"

    def hop_name(self, stage: int, tp_rank: int) -> str:
        return f"{self.base_name}-hop{stage}.{tp_rank}"

    @property
    def logits_name(self) -> str:
        return f"{self.base_name}-logits"

    def segments(self) -> dict[str, int]:
        """Every segment but the world one -> its number of ranks."""
        found = {}
        for stage in range(self.pp_size):
            if self.tp_size > 1:
                found[self.tp_name(stage)] = self.tp_size
            if stage < self.pp_size - 1:
                found.update({self.hop_name(stage, i): 2 for i in range(self.tp_size)})
        found[self.logits_name] = 2
        return found

    def members(self, name: str) -> list[int]:
        """The ranks that take part in segment name, in rank order."""
        return [rank for rank in range(self.world_size) if name in self.memberships(rank)]

    def memberships(self, rank: int) -> dict[str, tuple[int, int]]:
        """The segments rank takes part in -> (their number of ranks, its index there)."""
        stage, tp_rank = self.position(rank)
        member = {}
        if self.tp_size > 1:
            member[self.tp_name(stage)] = (self.tp_size, tp_rank)
        if stage > 0:
            member[self.hop_name(stage - 1, tp_rank)] = (2, 1)
        if stage < self.pp_size - 1:
            member[self.hop_name(stage, tp_rank)] = (2, 0)
        if stage == self.pp_size - 1 and tp_rank == 0:
            member[self.logits_name] = (2, 0)
        if rank == 0:
            member[self.logits_name] = (2, 1)
        return member


class Hop:
    """One direction of a two-rank communicator: index 0 sends, index 1 receives."""

    def __init__(self, comm):
        self.comm = comm

    def send(self, tensor: torch.Tensor) -> None:
        self.comm.broadcast(tensor.contiguous(), 0)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self.comm.broadcast(out, 0)
        return out


@dataclass
class StageLinks:
    """What one rank of one stage communicates through, beyond the world segment."""

    stage: int
    tp_rank: int
    tp_comm: object | None  # stage's TP communicator; None at TP 1
    from_previous: Hop | None  # stages after the first
    to_next: Hop | None  # stages before the last
    logits: Hop | None  # the last stage's tp rank 0 sends on it, rank 0 receives
    comms: list  # every communicator this rank holds (rank 0: every segment), to abort

    def aborted(self) -> bool:
        return any(c.aborted for c in self.comms)


def create_segments(layout: PipelineLayout) -> StageLinks:
    """Rank 0: creates every segment but the world one; -> rank 0's links."""
    member = layout.memberships(0)
    comms = {name: _native.ShmCommunicator(name, member.get(name, (size, 0))[1], size,
                                           layout.slot_bytes, create=True)
             for name, size in layout.segments().items()}
    return _links(layout, 0, comms, list(comms.values()))


def attach_segments(layout: PipelineLayout, rank: int) -> StageLinks:
    """A worker: attaches to the segments its rank takes part in."""
    comms = {name: _native.ShmCommunicator(name, index, size, layout.slot_bytes, create=False)
             for name, (size, index) in layout.memberships(rank).items()}
    return _links(layout, rank, comms, list(comms.values()))


def links_over(layout: PipelineLayout, rank: int, comms: dict) -> StageLinks:
    """rank's links over comms (segment name -> its communicator, shared memory or gloo)."""
    return _links(layout, rank, comms, list(comms.values()))


def _links(layout: PipelineLayout, rank: int, comms: dict, held: list) -> StageLinks:
    stage, tp_rank = layout.position(rank)
    last = layout.pp_size - 1
    hop = lambda name: Hop(comms[name]) if name in layout.memberships(rank) else None
    return StageLinks(
        stage, tp_rank, comms.get(layout.tp_name(stage)) if layout.tp_size > 1 else None,
        hop(layout.hop_name(stage - 1, tp_rank)) if stage > 0 else None,
        hop(layout.hop_name(stage, tp_rank)) if stage < last else None,
        hop(layout.logits_name) if rank == 0 or (stage == last and tp_rank == 0) else None,
        held)
