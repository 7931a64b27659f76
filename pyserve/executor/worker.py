"""A worker process (ranks 1..N-1): attach to rank 0's communicator (and, under pipeline
parallelism, to its stage's segments), load this rank's shard, then run every step rank 0
sends until the communicators are aborted (shutdown, or a peer's death) or rank 0 is gone."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import torch

from pyserve.executor.pipeline import PipelineLayout, attach_segments
from pyserve.executor.shard import ShardSpec, build_model_runner, build_stage_runner
from pyserve.executor.step_channel import StepChannel
from pyserve.model.layers.parallel import TPGroup

logger = logging.getLogger("pyserve")


@dataclass(frozen=True)
class WorkerArgs:
    spec: ShardSpec
    rank: int
    shm_name: str
    slot_bytes: int
    num_threads: int
    nccl_id: bytes | None = None  # CUDA: rank 0's NCCL unique id
    pipeline: PipelineLayout | None = None  # pipeline parallelism's segments


def worker_main(args: WorkerArgs) -> None:
    # Ctrl-C reaches the whole process group; rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s pyserve (rank {args.rank}): %(message)s")
    from pyserve import _native

    spec = args.spec
    torch.set_num_threads(args.num_threads)
    comm = _native.ShmCommunicator(args.shm_name, args.rank, spec.world_size, args.slot_bytes,
                                   create=False)
    links = attach_segments(args.pipeline, args.rank) if args.pipeline is not None else None
    try:
        comm.barrier()  # attached: rank 0 may now unlink the segments' names
        if links is not None:
            runner = build_stage_runner(spec, links)
        else:
            model_comm = comm
            if spec.device == "cuda":
                torch.cuda.set_device(args.rank)
                model_comm = _native.NcclCommunicator(args.nccl_id, args.rank, spec.tensor_parallel_size)
            runner = build_model_runner(spec, TPGroup(args.rank, spec.tensor_parallel_size, model_comm))
        comm.barrier()  # loaded
        logger.info("worker ready (pid %d)", os.getpid())
        channel = StepChannel(comm)
        while True:
            runner.execute_model(channel.receive())
    except RuntimeError:
        if comm.aborted or (links is not None and links.aborted()):
            # shutdown, or another rank died: rank 0 handles it
            return
        raise
