"""A tensor-parallel rank (1..N-1) as a Ray actor: describe() says where it runs; serve() joins
the group's communicator, loads this rank's shard, then runs every step rank 0 sends until
the communicator is aborted (shutdown) or a peer is gone.

serve() is one long call on purpose: rank 0 holds its object ref, which Ray resolves, with
RayActorError, the moment the actor dies; that is how rank 0 learns of a death without
polling. Steps arrive over the communicator (step_channel.py's layout), never through Ray.

This module does not import ray: rank 0 wraps the class with ray.remote when the Ray backend is
chosen, and Ray imports this module in each actor."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pyserve.executor.ray_collectives import Collectives, connect
from pyserve.executor.shard import ShardSpec, build_model_runner
from pyserve.executor.step_channel import StepChannel
from pyserve.model.layers.parallel import TPGroup

logger = logging.getLogger("pyserve")


@dataclass(frozen=True)
class RankStart:
    spec: ShardSpec
    rank: int
    num_threads: int  # the CPUs of the rank's bundle
    collectives: Collectives


@dataclass(frozen=True)
class RankInfo:
    node_id: str
    node_ip: str
    pid: int


class RayWorker:
    def describe(self) -> RankInfo:
        import ray  # inside an actor, Ray is already imported

        context = ray.get_runtime_context()
        return RankInfo(context.get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def serve(self, start: RankStart) -> None:
        """Returns when rank 0 aborts the communicator; raises if a peer fails."""
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s pyserve (rank {start.rank}): %(message)s")
        spec, size = start.spec, start.collectives.world_size
        torch.set_num_threads(start.num_threads)
        comm = connect(start.collectives, start.rank, self.describe().node_ip)
        try:
            if start.collectives.kind == "shm":
                comm.barrier()  # attached: rank 0 may now unlink the segment's name
            runner = build_model_runner(spec, TPGroup(start.rank, size, comm))
            comm.barrier()  # loaded
            logger.info("rank ready (pid %d, %s collectives, %d threads)", os.getpid(),
                        start.collectives.kind, start.num_threads)
            channel = StepChannel(comm)
            while True:
                runner.execute_model(channel.receive())
        except RuntimeError:
            if comm.aborted:  # shutdown: rank 0 stops the group
                return
            raise
