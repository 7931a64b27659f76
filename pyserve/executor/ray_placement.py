"""Where the ranks of a Ray-served model run: one placement-group bundle per rank, in rank
order, each reserving the CPUs its rank's threads use; bundle 0 is rank 0 itself (the server
process), so it is pinned to the driver's node (Ray's ray.io/node-id label), which keeps the
CPUs rank 0 computes on out of Ray's hands.

A tensor-parallel group that fits on the driver's node is STRICT_PACKed there (shared-memory
collectives); one that does not is PACKed: Ray fills the driver's node first, then others
(gloo collectives). Pipeline stages, when they come, are more groups: one placement group per
stage, each placed by group_placement, ranks numbered stage-major (rank = stage * tp + tp_rank)."""

from __future__ import annotations

from dataclasses import dataclass

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class GroupPlacement:
    cpus_per_rank: int
    strategy: str  # Ray's placement strategy: STRICT_PACK or PACK
    bundles: tuple[dict, ...]  # one per rank
    label_selectors: tuple[dict, ...]  # one per bundle; the first pins rank 0

    @property
    def fits_one_node(self) -> bool:
        return self.strategy == "STRICT_PACK"


def group_placement(size: int, driver_node_id: str, driver_node_cpus: int,
                    cpus_per_rank: int | None = None) -> GroupPlacement:
    """cpus_per_rank None: the driver node's CPUs shared by the group's ranks (at least 1)."""
    cpus = cpus_per_rank or max(1, driver_node_cpus // size)
    strategy = "STRICT_PACK" if cpus * size <= driver_node_cpus else "PACK"
    bundles = tuple({"CPU": float(cpus)} for _ in range(size))
    selectors = ({NODE_ID_LABEL: driver_node_id},) + tuple({} for _ in range(size - 1))
    return GroupPlacement(cpus, strategy, bundles, selectors)
