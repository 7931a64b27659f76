"""The single-process executor: tensor-parallel size 1, the model in this process."""

from __future__ import annotations

import os
from collections.abc import Callable

from pyserve.executor.shard import ShardSpec, build_model_runner
from pyserve.model.layers.parallel import SINGLE
from pyserve.model.runner import LaunchedStep, PreparedBatch, StepResult


class UniprocExecutor:
    description = "single process"

    def __init__(self, spec: ShardSpec, max_num_batched_tokens: int = 0):
        self.runner = build_model_runner(spec, SINGLE)
        self.failure: str | None = None

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid()]

    def execute(self, batch: PreparedBatch) -> StepResult:
        return self.runner.run(batch)

    def launch(self, batch: PreparedBatch, notify) -> LaunchedStep:
        return self.runner.launch(batch, notify)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Nothing outside this process can fail under it."""

    def shutdown(self) -> None:
        pass
