"""Executors run each step's forward pass on every tensor-parallel rank.

    single process (uni): rank 0 only, in this process; tensor-parallel size 1.
    multiprocess (mp):    rank 0 in this process, ranks 1..N-1 in spawned worker processes,
                          in lock step through pyserve._C's communicators.
    ray:                  rank 0 in this process, ranks 1..N-1 Ray actors on this node or
                          others, through shared memory on one node or gloo across nodes
                          (ray_executor.py; Ray is imported only when it is chosen).

Each takes a ShardSpec and offers base.Executor's interface (prepare, execute, launch, finish,
profile_run, on_failure, shutdown). executor_class() is the one place that picks."""

from __future__ import annotations

import functools

from pyserve.config import ParallelConfig
from pyserve.errors import ModelLoadError


def executor_class(parallel: ParallelConfig):
    backend = parallel.distributed_executor_backend
    if backend is None:
        backend = "mp" if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1 else "uni"
    if backend == "uni":
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            raise ModelLoadError("--distributed-executor-backend uni runs one rank only; use mp "
                                 "for --tensor-parallel-size > 1")
        from pyserve.executor.uniproc import UniprocExecutor

        return UniprocExecutor
    if backend == "mp":
        from pyserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    if backend == "ray":
        from pyserve.executor.ray_executor import RayExecutor

        return functools.partial(RayExecutor, parallel=parallel)
    raise ModelLoadError(f"--distributed-executor-backend {backend} is not available; use mp, ray or uni")
