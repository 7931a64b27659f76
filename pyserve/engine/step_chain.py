"""Async scheduling on the CPU: the model thread goes from one step straight into the next.

Without it, between two forwards the model thread waits for the event loop to wake up, apply
the last step's results, schedule and prepare the next step and hand it back: about 0.55 ms of
a 5 ms served decode step on two cores, while the model's threads sit idle. With it, the loop
offers the next step (a continuation, engine/continuation.py) while the current one runs; when
the current step ends, the model thread takes the offer, fills in the tokens just sampled,
hands the results to the loop and runs the offered step at once. The loop applies the results,
streams them and offers the step after, all while the model computes.

The loop decides everything: an offer is taken only if it is still there when the running step
ends. claim() tells the loop, once it has that step's results, whether its offer was taken (the
model thread runs it: the loop awaits its results next) or not (it is withdrawn; the loop
schedules as usual). withdraw() takes an offer back before it is taken: a new request's
prefill goes into the next step instead of waiting a step behind the continuation.

Nothing runs after a step that failed: its offer is dropped and the loop hears of the failure."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from dataclasses import dataclass


@dataclass
class _Offer:
    prepared: object  # the runner's PreparedBatch, its tokens placeholders
    rows: list[int]  # its row i takes the running step's sampled row rows[i]
    future: asyncio.Future
    step: object  # the engine's SchedulerOutput for it
    taken: bool = False


class StepChain:
    def __init__(self, loop: asyncio.AbstractEventLoop, model_thread: Executor, run):
        """run(prepared) -> ModelRunnerOutput: one step (EngineCore.run), on model_thread."""
        self._loop = loop
        self._model_thread = model_thread
        self._run = run
        self._lock = threading.Lock()
        self._pending: _Offer | None = None  # offered, not yet taken
        self._last: _Offer | None = None  # the loop's latest offer, taken or not
        self.num_chained = 0  # steps the model thread started from an offer

    def start(self, prepared) -> asyncio.Future:
        """Runs a step (and whatever offers follow it) on the model thread; the future gets
        its results."""
        future = self._loop.create_future()
        self._model_thread.submit(self._drive, prepared, future)
        return future

    def offer(self, step, prepared, rows: list[int]) -> None:
        """The step to run after the running one, if the model thread gets to it."""
        offer = _Offer(prepared, rows, self._loop.create_future(), step)
        with self._lock:
            self._pending = self._last = offer

    def withdraw(self) -> None:
        with self._lock:
            self._pending = None

    def claim(self):
        """After the running step's results are in: (its offered step, its prepared batch,
        the future of its results) if the model thread took the offer, else None (no offer
        stands)."""
        with self._lock:
            offer, self._last, self._pending = self._last, None, None
        if offer is None or not offer.taken:
            return None
        return offer.step, offer.prepared, offer.future

    def _drive(self, prepared, future: asyncio.Future) -> None:
        while True:
            try:
                result = self._run(prepared)
            except BaseException as exc:  # noqa: BLE001 (the loop re-raises it)
                with self._lock:
                    self._pending = None
                self._resolve(future, None, exc)
                return
            with self._lock:
                offer, self._pending = self._pending, None
                if offer is not None:
                    offer.taken = True
                    self.num_chained += 1
            if offer is not None:
                try:
                    sampled = result.sampled.token_ids
                    offer.prepared.fill_tokens([sampled[row] for row in offer.rows])
                except BaseException as exc:  # noqa: BLE001 (the loop re-raises it)
                    self._resolve(future, result, None)
                    self._resolve(offer.future, None, exc)
                    return
            self._resolve(future, result, None)
            if offer is None:
                return
            prepared, future = offer.prepared, offer.future

    def _resolve(self, future: asyncio.Future, result, exc: BaseException | None) -> None:
        def resolve():
            if future.done():  # cancelled: the loop is shutting down
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

        try:
            self._loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # the loop is closed: nobody waits for this step
            pass
