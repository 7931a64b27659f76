"""A test-only fault: the model step numbered `step` (1-based, counted over the engine's model
steps) raises InjectedFault instead of running. It exists so that tests can check what a
failed step does end to end: its requests end with an error their clients see, the books
count them as errored, and the engine goes on stepping for everyone else (engine/
async_engine.py). Set from SchedulerConfig.test_fault_step ($PYSERVE_TEST_FAULT_STEP, read
by the CLI); unset, the engine holds no StepFault and a step pays one `is None` test."""

from __future__ import annotations


class InjectedFault(RuntimeError):
    """The fault a test asked for; nothing is broken."""


class StepFault:
    def __init__(self, step: int):
        self.step = step
        self.steps_seen = 0

    def before_step(self) -> None:
        """Counts a model step; raises at the chosen one, once."""
        self.steps_seen += 1
        if self.steps_seen == self.step:
            raise InjectedFault(f"fault injected at model step {self.step} "
                                "($PYSERVE_TEST_FAULT_STEP)")
