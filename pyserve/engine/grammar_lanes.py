"""Where and when a request's grammar compiles, so that no request's grammar can hold up
everyone else's.

- Sizes first: a spec past structured/limits.py's limits is refused before anything runs.
- One compile per distinct grammar: requests that send the same spec while it compiles wait
  for that one compile, so a flood of identical grammars queues nothing.
- Two lanes. Small specs compile in this process on SMALL_LANE_THREADS threads (fast: no
  copy of the result). Big ones (limits.is_big) compile one at a time in a worker process
  (structured/compile_process.py); when every request waiting for a big compile has timed out
  or gone, the compile is dropped from the queue, or its process killed, so abandoned work
  stops at once. A big grammar never takes a small-lane thread, so a one-property schema
  compiles promptly while big ones run.
- Bounded queues: at most MAX_PENDING_SMALL distinct small compiles and MAX_PENDING_BIG big
  ones (running and waiting) at once; past either, a request is refused at once (a 400, as
  vLLM's compile-slot refusal) instead of waiting behind work it cannot overtake. A small
  compile whose requests timed out still counts until its thread finishes: a thread cannot
  be stopped, and counting it keeps the small lane's backlog bounded.

Everything here runs on the event loop except the compiles themselves."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pyserve.executor.threads import serial_thread_pool
from pyserve.structured.compile_process import CompileProcess
from pyserve.structured.compiler import GrammarCompiler, GrammarError, canonical_text, key_of
from pyserve.structured.limits import is_big

SMALL_LANE_THREADS = 2
MAX_PENDING_SMALL = 16
MAX_PENDING_BIG = 2


class _Pending:
    """One compile in flight and how many requests wait for it."""

    def __init__(self, task: asyncio.Task, big: bool):
        self.task, self.big, self.waiters = task, big, 0


class GrammarLanes:
    def __init__(self, grammars: GrammarCompiler):
        self._grammars = grammars
        self._threads: ThreadPoolExecutor | None = None  # the small lane, made on its first grammar
        self._big_thread: ThreadPoolExecutor | None = None  # reads the process's results (MBs)
        self._process = CompileProcess(grammars.tokenizer_info_json)
        self._big_turn = asyncio.Lock()  # the process compiles one grammar at a time
        self._pending: dict[str, _Pending] = {}  # by the grammar's cache key
        self._vocabulary: asyncio.Future | None = None  # read once, before the first compile

    async def compile(self, spec, timeout_s: float) -> None:
        """Compiles spec into the grammar cache, or raises GrammarError: too big, the lanes
        full, not compilable, or not compiled within timeout_s."""
        text = canonical_text(spec)  # GrammarError if too big
        key = key_of(text)
        if self._grammars.cached(spec, key) is not None:
            return
        pending = self._pending.get(key) or self._submit(key, spec, is_big(text))
        pending.waiters += 1
        try:
            await self._started(pending.big)
            await asyncio.wait_for(asyncio.shield(pending.task), timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError("structured_outputs", f"the grammar did not compile within "
                               f"{timeout_s:g} s; simplify it") from None
        finally:
            pending.waiters -= 1
            if pending.waiters == 0 and pending.big and not pending.task.done():
                pending.task.cancel()  # nobody waits: drop it from the queue, or kill its process
                self._forget(key, pending)  # a request for it from now on starts it again

    async def _started(self, big: bool) -> None:
        """What a lane needs once, not counted in any grammar's time: the vocabulary read
        (a second or more for 50k tokens), and for big grammars the worker process started
        (Python, torch and the vocabulary: seconds)."""
        if self._vocabulary is None:
            self._vocabulary = asyncio.get_running_loop().run_in_executor(
                self._small_lane(), self._grammars.prepare)
        await asyncio.shield(self._vocabulary)
        if big:
            await self._process.ready()

    def _submit(self, key: str, spec, big: bool) -> _Pending:
        lane = [p for p in self._pending.values() if p.big == big]
        limit = MAX_PENDING_BIG if big else MAX_PENDING_SMALL
        if len(lane) >= limit:
            raise GrammarError("structured_outputs", f"{len(lane)} {'large ' if big else ''}grammars "
                               "are compiling already, the most this server queues; retry shortly")
        task = asyncio.get_running_loop().create_task(self._compile_big(key, spec) if big
                                                      else self._compile_small(spec))
        pending = self._pending[key] = _Pending(task, big)
        task.add_done_callback(lambda done: self._finished(key, pending))
        return pending

    def _forget(self, key: str, pending: _Pending) -> None:
        if self._pending.get(key) is pending:
            del self._pending[key]

    def _finished(self, key: str, pending: _Pending) -> None:
        self._forget(key, pending)
        if not pending.task.cancelled():
            pending.task.exception()  # retrieved: a GrammarError nobody waited for is no error

    def _small_lane(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = serial_thread_pool(SMALL_LANE_THREADS, "pyserve-grammar")
        return self._threads

    async def _compile_small(self, spec) -> None:
        await asyncio.get_running_loop().run_in_executor(self._small_lane(), self._grammars.compile, spec)

    async def _compile_big(self, key: str, spec) -> None:
        async with self._big_turn:
            serialized = await self._process.compile(spec)
            if self._big_thread is None:
                self._big_thread = serial_thread_pool(1, "pyserve-grammar-big")
            compiled = await asyncio.get_running_loop().run_in_executor(
                self._big_thread, self._grammars.deserialize, serialized)
        self._grammars.store(key, compiled)

    def shutdown(self) -> None:
        self._process.close()
        for pool in (self._threads, self._big_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
