"""A rank (1..N-1) as a Ray actor: describe() says where it runs; serve() joins the world's
communicators (under pipeline parallelism also its stage's, ray_collectives.py), loads this
rank's shard, then runs every step rank 0 sends until the communicator is aborted (shutdown)
or a peer is gone.

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

from pyserve.executor.ray_collectives import Collectives, connect, connect_links, rank_store
from pyserve.executor.shard import ShardSpec, build_model_runner, build_stage_runner
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
        spec, plan = start.spec, start.collectives
        torch.set_num_threads(start.num_threads)
        host = self.describe().node_ip
        store = rank_store(plan, start.rank)
        comm = connect(plan, start.rank, host, store)
        links = None
        try:
            if plan.kind == "shm":
                comm.barrier()  # attached: rank 0 may now unlink the segment's name
            if plan.pipeline is not None:
                links = connect_links(plan, start.rank, host, comm, store)
                runner = build_stage_runner(spec, links)
            else:
                runner = build_model_runner(spec, TPGroup(start.rank, plan.world_size, comm))
            comm.barrier()  # loaded
            logger.info("rank ready (pid %d, %s collectives, %d threads)", os.getpid(),
                        start.collectives.kind, start.num_threads)
            channel = StepChannel(comm)
            while True:
                runner.execute_model(channel.receive())
        except RuntimeError:
            if comm.aborted or (links is not None and links.aborted()):  # shutdown
                return
            raise
