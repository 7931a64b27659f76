"""Where the ranks of a Ray-served model run: one placement-group bundle per rank, each
reserving the CPUs its rank's threads use; rank 0's bundle is the server process itself, so it
is pinned to the driver's node (Ray's ray.io/node-id label), which keeps the CPUs rank 0
computes on out of Ray's hands.

A world (TP * PP ranks) that fits on the driver's node is one group, STRICT_PACKed there:
every communicator is shared memory. One that does not fit:
    PP 1   one group, PACKed: Ray fills the driver's node first, then others (gloo);
    PP > 1 one group per pipeline stage (its TP ranks), STRICT_PACKed when the stage fits the
           largest node (stage 0's group, pinned to the driver's node: when it fits that
           node), so that a stage's all-reduces stay in one node's shared memory and only the
           hops between stages (one tensor per micro-batch) cross the network.
Ranks are numbered stage-major (rank = stage * tp + tp_rank), as vLLM numbers them."""

from __future__ import annotations

from dataclasses import dataclass

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class GroupPlacement:
    cpus_per_rank: int
    strategy: str  # Ray's placement strategy: STRICT_PACK or PACK
    bundles: tuple[dict, ...]  # one per rank
    label_selectors: tuple[dict, ...]  # one per bundle; rank 0's pins it to the driver's node
    first_rank: int = 0  # the rank of the first bundle

    @property
    def fits_one_node(self) -> bool:
        return self.strategy == "STRICT_PACK"

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + len(self.bundles))


def world_placement(tp_size: int, pp_size: int, driver_node_id: str, driver_node_cpus: int,
                    largest_node_cpus: int, cpus_per_rank: int | None = None
                    ) -> list[GroupPlacement]:
    """The placement groups of a TP * PP world, in rank order (the module's rules).
    cpus_per_rank None: the driver node's CPUs shared by every rank (at least 1)."""
    size = tp_size * pp_size
    cpus = cpus_per_rank or max(1, driver_node_cpus // size)
    if cpus * size <= driver_node_cpus:
        return [_group(0, size, cpus, "STRICT_PACK", driver_node_id)]
    if pp_size == 1:
        return [_group(0, size, cpus, "PACK", driver_node_id)]
    def strategy(stage: int) -> str:  # stage 0 is pinned to the driver's node
        room = driver_node_cpus if stage == 0 else largest_node_cpus
        return "STRICT_PACK" if cpus * tp_size <= room else "PACK"

    return [_group(stage * tp_size, tp_size, cpus, strategy(stage), driver_node_id)
            for stage in range(pp_size)]


def _group(first_rank: int, size: int, cpus: int, strategy: str, driver_node_id: str) -> GroupPlacement:
    bundles = tuple({"CPU": float(cpus)} for _ in range(size))
    selectors = tuple({NODE_ID_LABEL: driver_node_id} if first_rank + i == 0 else {}
                      for i in range(size))
    return GroupPlacement(cpus, strategy, bundles, selectors, first_rank)
