"""The single-process executor: tensor-parallel size 1, the model in this process."""

from __future__ import annotations

import os

from pyserve.executor.base import Executor
from pyserve.executor.shard import ShardSpec, build_model_runner
from pyserve.model.layers.parallel import SINGLE


class UniprocExecutor(Executor):
    description = "single process"
    chains_steps = True

    def __init__(self, spec: ShardSpec):
        self.runner = build_model_runner(spec, SINGLE)

    @property
    def rank_pids(self) -> list[int]:
        return [os.getpid()]
