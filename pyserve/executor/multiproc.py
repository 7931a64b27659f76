"""The multiprocess executor: rank 0 runs in this process (the model thread drives it), ranks
1..N-1 in worker processes spawned at start-up, all in lock step.

Each step rank 0 broadcasts the step's inputs through shared memory, then every rank runs
the forward pass; the layers' all-reduces and the logits gather go through pyserve._C's
communicator (shared memory on the CPU, NCCL on CUDA). A watchdog thread waits on the
workers' process sentinels: a worker that exits (outside shutdown) aborts the communicator,
so any collective in flight on rank 0 raises at once instead of hanging, and the failure
callback tells the engine. Shutdown aborts the communicator too, which ends the workers'
wait for the next step; stragglers are terminated, so no rank outlives the server. The
shared-memory segment's name is unlinked as soon as every rank has attached, so nothing is
left in /dev/shm however the processes end.

Pipeline parallelism (ShardSpec.pipeline_parallel_size > 1): TP * PP ranks, rank = stage * TP
+ tp_rank; the step broadcast still reaches every rank, while each stage's all-reduces, the
hops between stages and the logits back to rank 0 go through segments of their own
(pipeline.py), every one of which the watchdog and shutdown abort."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from pyserve import _native
from pyserve.executor.base import Executor
from pyserve.executor.pipeline import PipelineLayout, create_segments
from pyserve.executor.shard import ShardSpec, build_model_runner, build_stage_runner
from pyserve.executor.step_channel import StepChannel
from pyserve.executor.worker import WorkerArgs, worker_main
from pyserve.errors import InvalidRequest, ModelLoadError
from pyserve.model.layers.parallel import TPGroup
from pyserve.model.runner import ForwardInputs, PreparedBatch
from pyserve.step import SchedulerOutput

logger = logging.getLogger("pyserve")

# Larger collectives go through a slot in chunks; this bounds the segment, not the tensors.
MAX_SLOT_BYTES = 32 << 20
# A worker's exit status when it found itself re-running the user's script at import
WORKER_BOOTSTRAP_EXIT = 3
UNGUARDED_SCRIPT = (
    "tensor_parallel_size > 1 starts worker processes, which import your script again: create "
    "the LLM under `if __name__ == \"__main__\":` (or in a function called from there), not at "
    "the top level of the script")


def refuse_in_bootstrapping_child() -> None:
    """Called before any worker is started. In a process that spawn is still bootstrapping
    (a worker re-running the unguarded top level of the user's script), starting workers
    would fail with multiprocessing's RuntimeError about the bootstrapping phase; this exits
    instead: quietly in one of our workers (its parent reports UNGUARDED_SCRIPT), with the
    sentence in any other process."""
    if not getattr(mp.current_process(), "_inheriting", False):  # what spawn itself checks
        return
    if mp.current_process().name.startswith("pyserve-tp-rank"):
        raise SystemExit(WORKER_BOOTSTRAP_EXIT)
    raise SystemExit(UNGUARDED_SCRIPT)


def slot_bytes(spec: ShardSpec) -> int:
    """Room for one step's hidden states in one piece."""
    hidden = spec.max_num_batched_tokens * spec.arch.hidden_size * spec.dtype.itemsize
    return min(max(hidden, 1 << 20), MAX_SLOT_BYTES)


class MultiprocExecutor(Executor):
    description = "multiprocess"

    def __init__(self, spec: ShardSpec):
        refuse_in_bootstrapping_child()
        size, tp_size = spec.world_size, spec.tensor_parallel_size
        self.pipelined = spec.pipeline_parallel_size > 1
        if spec.device == "cuda" and not _native.built_with_nccl():
            raise ModelLoadError("this build of pyserve._C has no NCCL: tensor parallelism on CUDA "
                                 "needs NCCL at build time")
        self.failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._stopping = threading.Event()
        cpus = len(os.sched_getaffinity(0))
        threads = max(1, cpus // size)
        if spec.device == "cpu":
            torch.set_num_threads(threads)  # the ranks share this machine's cores
        name = f"/pyserve-tp-{os.getpid()}-{secrets.token_hex(6)}"
        slot = slot_bytes(spec)
        self.comm = _native.ShmCommunicator(name, 0, size, slot, create=True)
        self.comms = [self.comm]  # every segment: the watchdog and shutdown abort them all
        layout = links = None
        if self.pipelined:  # created before any worker starts, so that each can attach
            layout = PipelineLayout(tp_size, spec.pipeline_parallel_size, name, slot)
            links = create_segments(layout)
            self.comms += links.comms
        nccl_id = _native.nccl_unique_id() if spec.device == "cuda" else None
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=worker_main, name=f"pyserve-tp-rank{rank}", daemon=True,
                                    args=(WorkerArgs(spec, rank, name, slot, threads, nccl_id,
                                                     layout),))
                        for rank in range(1, size)]
        for process in self.workers:
            process.start()
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._watchdog = threading.Thread(target=self._watch, name="pyserve-tp-watchdog", daemon=True)
        self._watchdog.start()
        # also runs if this executor is garbage-collected, and at interpreter exit
        self._finalizer = weakref.finalize(self, _stop_workers, self._stopping, self._wake_w,
                                           self.comms, self.workers)
        try:
            self.comm.barrier()  # every rank attached
            for comm in self.comms:
                comm.unlink()
            if self.pipelined:  # CPU only (plan.py): the stage's own all-reduce segment
                self.runner = build_stage_runner(spec, links)
            else:
                model_comm = self.comm
                if spec.device == "cuda":
                    torch.cuda.set_device(0)
                    model_comm = _native.NcclCommunicator(nccl_id, 0, size)
                self.runner = build_model_runner(spec, TPGroup(0, size, model_comm))
            self.comm.barrier()  # every rank loaded
        except Exception as exc:
            self.shutdown()
            kind = "pipeline-parallel" if self.pipelined else "tensor-parallel"
            error = ModelLoadError(f"{kind} start-up failed: {self.failure or exc}")
            if self.failure == UNGUARDED_SCRIPT:
                raise error from None  # the cause is the script, not the communicator's abort
            raise error from exc
        self.channel = StepChannel(self.comm)
        logger.info("%s: %d ranks (rank 0 pid %d, workers %s), %d thread(s) each",
                    f"pipeline parallel ({spec.pipeline_parallel_size} stages of {tp_size} ranks)"
                    if self.pipelined else "tensor parallel",
                    size, os.getpid(), ", ".join(str(p.pid) for p in self.workers), threads)

    def prepare(self, step: SchedulerOutput) -> PreparedBatch:
        batch = super().prepare(step)
        if self.pipelined and batch.pooling:
            # the final hidden states stay on the last stage; only the logits come back
            raise InvalidRequest(None, "embeddings from a decoder are not served under "
                                 "--pipeline-parallel-size > 1")
        return batch

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid(), *(p.pid for p in self.workers)]

    def _broadcast(self, inputs: ForwardInputs) -> None:
        self.channel.send(inputs)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """callback(reason) runs on the watchdog thread when a worker dies outside shutdown."""
        self._callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.workers}
        ready = wait([*sentinels, self._wake_r])
        if self._stopping.is_set():
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        if not dead:
            return
        process = dead[0]
        process.join(0.5)  # the sentinel can fire just before the exit status exists
        self.failure = (f"{'pipeline' if self.pipelined else 'tensor'}-parallel worker "
                        f"{process.name} (pid {process.pid}) exited with code {process.exitcode}")
        if process.exitcode == WORKER_BOOTSTRAP_EXIT:
            self.failure = UNGUARDED_SCRIPT  # start-up raises it
        else:
            logger.error("%s; the engine cannot continue", self.failure)
        for comm in self.comms:
            comm.abort()
        for callback in self._callbacks:
            callback(self.failure)

    def shutdown(self) -> None:
        self._finalizer()  # runs once


def _stop_workers(stopping: threading.Event, wake_watchdog, comms: list, workers: list,
                  timeout: float = 5.0) -> None:
    """Ends the workers: the abort wakes them from their wait for the next step."""
    stopping.set()
    wake_watchdog.send_bytes(b"x")
    for comm in comms:
        comm.abort()
        comm.unlink()
    deadline = time.monotonic() + timeout
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.is_alive():
            process.kill()
            process.join(1.0)
