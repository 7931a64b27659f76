"""What every executor offers the engine, which reaches the model through nothing else:

    prepare(step)        SchedulerOutput -> PreparedBatch (rank 0's runner, on the caller's thread)
    execute(batch)       forward + sampling on every rank -> ModelRunnerOutput (the model thread)
    launch(batch, fd)    CUDA: queue the step, write the eventfd fd when done; finish() reads it
    profile_run(step)    one forward of a dummy step, timed

A subclass says how a step reaches the other ranks (_broadcast) and how they are started,
watched and stopped."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pyserve import _native
from pyserve.model.runner import ForwardInputs, LaunchedStep, ModelRunner, PreparedBatch
from pyserve.step import ModelRunnerOutput, SchedulerOutput


class Executor:
    description = "executor"
    runner: ModelRunner  # rank 0's
    failure: str | None = None
    # speculative decoding with a draft model (model/draft_model.py): proposes a step's
    # drafts on rank 0 before the step reaches the other ranks
    drafter = None

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def rank_pids(self) -> list[int]:
        raise NotImplementedError

    # async scheduling on the CPU (engine/step_chain.py): execute() may be handed a batch
    # prepared before its tokens were sampled, which fill_tokens completed just before
    chains_steps = False

    @property
    def launches_async(self) -> bool:
        """CUDA: steps can be queued (launch) and awaited without a blocked thread (finish)."""
        return self.runner.device.type == "cuda" and _native.notify_when_done is not None

    def attach_draft_model(self, spec) -> None:
        """Loads the draft model (a ShardSpec from plan.resolve_draft, with the target's
        block count) on rank 0, beside the target."""
        from pyserve.executor.shard import build_model_runner
        from pyserve.model.draft_model import DraftModelProposer
        from pyserve.model.layers.parallel import SINGLE

        self.drafter = DraftModelProposer(build_model_runner(spec, SINGLE))

    def _broadcast(self, inputs: ForwardInputs) -> None:
        """Hands the step's inputs to the other ranks, just before rank 0 runs it."""

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RuntimeError(self.failure)

    def prepare(self, step: SchedulerOutput) -> PreparedBatch:
        return self.runner.prepare(step)

    def prepare_continuation(self, previous: PreparedBatch, step: SchedulerOutput) -> PreparedBatch:
        """Async scheduling: the step after `previous` (running now), built from it where it
        can be (ModelRunner.prepare_continuation)."""
        return self.runner.prepare_continuation(previous, step)

    def execute(self, batch: PreparedBatch) -> ModelRunnerOutput:
        self._check_alive()
        if self.drafter is not None:
            self.drafter.propose(batch)
        self._broadcast(batch.inputs)
        return self.runner.run(batch)

    def launch(self, batch: PreparedBatch, notify_fd: int) -> LaunchedStep:
        """Queues the step on the device; notify_fd (an eventfd) is written when it is done.
        May run off the caller's thread, like execute()."""
        self._check_alive()
        if self.drafter is not None:
            self.drafter.propose(batch)
        self._broadcast(batch.inputs)
        device = self.runner.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self.runner.launch(batch, lambda: _native.notify_when_done(notify_fd, index))

    def finish(self, launched: LaunchedStep) -> ModelRunnerOutput:
        return ModelRunner.finish(launched)

    def profile_run(self, step: SchedulerOutput) -> float:
        """Runs a dummy step (step.dummy_step) on every rank; returns its seconds."""
        start = time.perf_counter()
        self.execute(self.prepare(step))
        return time.perf_counter() - start

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """callback(reason), from another thread, when a rank dies outside shutdown."""

    def shutdown(self) -> None:
        """Stops the other ranks, if any. Nothing can run afterwards."""
