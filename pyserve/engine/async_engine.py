"""The engine on an asyncio (uvloop) event loop.

The step loop is a task on the same loop as everything else: it schedules, prepares the
batch, then awaits the forward pass and sampling, which run in one dedicated model thread
(torch releases the GIL inside its kernels, so the loop keeps serving HTTP, tokenizing and
detokenizing meanwhile); back on the loop it applies the results and hands each request's
output to its stream. On the CPU the kernels are synchronous calls, so the model thread runs
the whole step. On CUDA it only queues the step on a stream (launch) and returns; the loop
then awaits an eventfd the stream writes when the step and the copy of its results are done
(engine/completion.py), so no thread sits blocked waiting on the device.

Request state is touched only on the loop. An abort that lands while a step runs frees the
request's blocks at once; nothing can reuse them before the step ends, because only the loop
schedules, after awaiting that step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pyserve.engine import beam_driver
from pyserve.engine.completion import StepCompletion
from pyserve.engine.core import EngineCore
from pyserve.engine.grammar_lanes import GrammarLanes
from pyserve.engine.output import CompletionOutput, RequestOutput
from pyserve.engine.step_chain import StepChain
from pyserve.errors import InvalidRequest
from pyserve.executor.threads import run_parallel_regions_serially, serial_thread_pool  # noqa: F401 (the server's)
from pyserve.pooling_params import ModelPooler, PoolingParams
from pyserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("pyserve")


class EngineDeadError(RuntimeError):
    """The engine's step failed; the request cannot complete."""


class AsyncEngine:
    def __init__(self, core: EngineCore, model_thread: ThreadPoolExecutor | None = None):
        """model_thread: the one thread that runs the model. Pass the thread that built the
        core and ran its warm-up: torch's OpenMP keeps a team of worker threads per calling
        thread, and two teams spinning on two cores cost a decode step a third of its speed."""
        self.core = core
        # The core knows a request as a serial number and the caller's id ("17#id"; its
        # completions "17#id#0", ...): an id used again right after an abort names a request of
        # its own, while the aborted one's step may still be running and its stream still open
        # (vLLM's internal ids do the same). The serial leads, so no caller's id can make a
        # core id another request's completions have.
        self._streams: dict[str, asyncio.Queue] = {}  # by the core's id
        self._core_ids: dict[str, str] = {}  # an open stream's id as its caller gave it -> the core's
        self._serial = itertools.count()
        self._has_work = asyncio.Event()
        self._model_thread = model_thread or ThreadPoolExecutor(1, thread_name_prefix="pyserve-model")
        self._task: asyncio.Task | None = None
        # loop-busy accounting: time on the loop vs time awaiting the model, summed over steps
        self.loop_busy_s = 0.0
        self.model_wait_s = 0.0
        self.num_steps = 0
        self.last_progress = time.monotonic()  # when a step last completed
        self._log_interval = core.config.scheduler.log_stats_interval
        self._last_log = time.monotonic()
        self._last_tokens = (0, 0)
        self.dead_reason: str | None = None
        self.died = asyncio.Event()  # set once the engine can never step again
        self._completion: StepCompletion | None = None  # CUDA: made on the first step
        self._grammar_lanes: GrammarLanes | None = None  # made on the first grammar
        self._chain: StepChain | None = None  # async scheduling (CPU), made by start()

    @classmethod
    def from_config(cls, config, model_thread: ThreadPoolExecutor) -> "AsyncEngine":
        """Builds the engine (model, KV cache, scheduler). Call it on model_thread (the server
        does, while /health answers "loading"), which then runs every step."""
        return cls(EngineCore(config), model_thread)

    # -- what the server reads: the engine's public face ----------------------------------------
    @property
    def config(self):
        return self.core.config

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every --served-model-name (a request may name any); the first is reported."""
        return self.core.config.model.served_model_name or (self.core.model_name,)

    @property
    def model_path(self) -> str:
        return str(self.core.model_path)

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def is_encoder(self) -> bool:
        """An embedding-only model (BERT-family): no generation."""
        return self.core.is_encoder

    @property
    def pooler(self) -> ModelPooler:
        return self.core.pooler

    @property
    def hidden_size(self) -> int:
        return self.core.plan.hidden_size

    @property
    def generation_defaults(self) -> dict:
        """The model's generation_config.json sampling values, for fields a request leaves out."""
        return self.core.generation_defaults

    @property
    def stats(self):
        return self.core.stats

    @property
    def num_kv_blocks(self) -> int:
        return self.core.kv.num_blocks

    def snapshot(self) -> dict:
        return self.core.snapshot()

    def books(self, count_references: bool = False) -> dict:
        """The core's books (engine/books.py) and the streams still open."""
        return {**self.core.books(count_references), "streams_open": len(self._streams)}

    @property
    def executor_description(self) -> str:
        return self.core.executor.description

    @property
    def rank_pids(self) -> list[int]:
        return self.core.executor.rank_pids

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    async def compile_grammar(self, spec, timeout_s: float) -> None:
        """Compiles a structured-output grammar into the engine's cache off the event loop
        (engine/grammar_lanes.py), so that admitting the request finds it compiled.
        GrammarError if it is too big, the compile queues are full, or it cannot be compiled,
        or not within timeout_s."""
        if self._grammar_lanes is None:
            self._grammar_lanes = GrammarLanes(self.core.grammars)
        await self._grammar_lanes.compile(spec, timeout_s)

    @property
    def grammar_stats(self) -> dict:
        return self.core.grammars.stats()

    async def warm_up(self) -> int:
        """The start-up warm-up forward, on the model thread; returns its token count."""
        tokens = self.core.warmup_tokens()
        await asyncio.get_running_loop().run_in_executor(self._model_thread, self.core.profile_run, tokens)
        return tokens

    def start(self) -> None:
        if self._task is None and self.dead_reason is None:
            loop = asyncio.get_running_loop()
            if self.core.async_scheduling:
                # looked up per step: the core's run may be replaced (fault tests)
                self._chain = StepChain(loop, self._model_thread, lambda prepared: self.core.run(prepared))
            self._task = loop.create_task(self._step_loop(), name="pyserve-steps")
            self.core.on_executor_failure(
                lambda reason: loop.call_soon_threadsafe(self._engine_died, reason))

    def _engine_died(self, reason: str) -> None:
        """A tensor-parallel rank is gone, or the step loop cannot go on: stop stepping, fail
        every open stream."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if self._task is not None:
            self._task.cancel()
        for request_id, queue in list(self._streams.items()):
            try:
                self.core.abort(request_id, "errored")
            except Exception:  # the state that killed the engine; the stream still gets told
                logger.exception("aborting %s after the engine died", request_id)
            queue.put_nowait(EngineDeadError(f"the engine died: {reason}"))
        self.died.set()

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._model_thread.shutdown(wait=True)
        if self._grammar_lanes is not None:
            self._grammar_lanes.shutdown()
        if self._completion is not None:
            self._completion.close()
            self._completion = None
        self.core.shutdown()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | BeamSearchParams,
                    request_id: str, prompt: str | None = None,
                    priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Admits the request now (ValueError if it can never run) and returns its stream.
        Leaving the iteration early (break, cancellation, a client gone) aborts the request;
        a stream never iterated must be ended with discard(). BeamSearchParams: beam_search."""
        if isinstance(params, BeamSearchParams):
            return self.beam_search(prompt_token_ids, params, request_id, prompt, priority)
        self._check_alive()
        core_id = self._new_core_id(request_id)
        self.core.add_request(core_id, prompt_token_ids, params, prompt=prompt, priority=priority)
        self._withdraw_offer()
        return self._open_stream(request_id, core_id)

    def add_pooling_request(self, prompt_token_ids: list[int], params: PoolingParams,
                            request_id: str, prompt: str | None = None,
                            priority: int = 0) -> AsyncIterator[RequestOutput]:
        """As add_request, for an embedding: its stream yields one output, whose `pooled`
        is the result."""
        self._check_alive()
        core_id = self._new_core_id(request_id)
        self.core.add_pooling_request(core_id, prompt_token_ids, params, prompt, priority)
        self._withdraw_offer()
        return self._open_stream(request_id, core_id)

    def check_pooling_request(self, prompt_token_ids: list[int], params: PoolingParams,
                              priority: int = 0) -> None:
        """InvalidRequest where add_pooling_request would raise it; adds nothing."""
        self.core.check_pooling_request(prompt_token_ids, params, priority)

    def _withdraw_offer(self) -> None:
        """A request arrived (its prefill joins the next step, not the one after a
        continuation offered before it came) or was aborted (it gets no row after its last)."""
        if self._chain is not None:
            self._chain.withdraw()

    def beam_search(self, prompt_token_ids: list[int], params: BeamSearchParams, request_id: str,
                    prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """vLLM's beam search over this engine (engine/beam_driver.py): checked now
        (InvalidRequest if it can never run), run as the stream is iterated; it yields one
        output, the n best beams. Leaving it early aborts its round's requests."""
        self._check_alive()
        search = beam_driver.start(self.core, prompt_token_ids, params, priority)
        return beam_driver.stream(self, search, request_id, prompt, prompt_token_ids, priority)

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine died: {self.dead_reason}")
        self.start()

    def _new_core_id(self, request_id: str) -> str:
        """The core's id for a new request under the caller's request_id, which a live request
        must not hold (one aborted or finished may: its stream can still be draining)."""
        current = self._core_ids.get(request_id)
        if current is not None and current in self.core.requests:
            raise InvalidRequest(None, f"request_id '{request_id}' is already in use")
        return f"{next(self._serial)}#{request_id}"

    def _open_stream(self, request_id: str, core_id: str) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[core_id] = queue
        self._core_ids[request_id] = core_id
        self._has_work.set()
        return self._stream(request_id, core_id, queue)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """add_request and iterate: the request is admitted when iteration starts."""
        async for output in self.add_request(prompt_token_ids, params, request_id, prompt, priority):
            yield output

    async def _stream(self, request_id: str, core_id: str,
                      queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                item.request_id = request_id  # the caller's id, not the core's
                yield item
        finally:
            self._streams.pop(core_id, None)
            if self._core_ids.get(request_id) == core_id:  # not yet a newer request's
                del self._core_ids[request_id]
            if not finished:
                self.core.abort(core_id)

    def abort_all(self) -> int:
        """Ends every open stream with an "abort" finish; returns how many."""
        ids = list(self._core_ids)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def num_waiting(self) -> int:
        return self.core.num_waiting()

    def is_active(self, request_id: str) -> bool:
        """The request was added and its stream is still open."""
        return self._core_ids.get(request_id) in self._streams

    def discard(self, request_id: str) -> None:
        """Ends a request whose stream nobody will read (never iterated, or already left):
        aborts it and drops the stream, so neither its blocks nor its queue stay behind. Like
        abort(), it names the latest request added under the id."""
        core_id = self._core_ids.pop(request_id, None)
        if core_id is not None:
            self.core.abort(core_id)
            self._streams.pop(core_id, None)

    def abort(self, request_id: str) -> None:
        core_id = self._core_ids.get(request_id)
        if core_id is None:  # never added, or its stream has ended
            return
        self.core.abort(core_id)
        self._withdraw_offer()  # not one more row for it
        queue = self._streams.get(core_id)
        if queue is not None:  # end the stream with an "abort" finish
            queue.put_nowait(RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "abort")],
                                           finished=True))

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        chained = None  # (step, prepared, future): the offered step the model thread went on to run
        while True:
            t0 = time.perf_counter()
            step = None
            try:
                if chained is not None:
                    (step, prepared, future), chained = chained, None
                else:
                    if not self.core.has_unfinished():
                        self._has_work.clear()
                        await self._has_work.wait()
                        continue
                    begun = self.core.begin_step()
                    if begun is None:  # nothing fits this instant; let aborts and arrivals happen
                        await asyncio.sleep(0)
                        continue
                    step, prepared = begun
                    future = self._launch(loop, prepared)
                if self._chain is not None:
                    self._offer_next(step, prepared)
                t1 = time.perf_counter()
                try:
                    result = await future
                finally:
                    if self._chain is not None:
                        chained = self._chain.claim()
                t2 = time.perf_counter()
                outputs = self.core.update(step, result)
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                if step is None:  # the scheduler itself: nothing to blame, nothing can run
                    self._engine_died(f"scheduling failed: {exc}")
                    return
                self._fail(step, exc)
                continue
            for output in outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            self.loop_busy_s += (t1 - t0) + (time.perf_counter() - t2)
            self.model_wait_s += t2 - t1
            self.num_steps += 1
            self.last_progress = time.monotonic()
            self._maybe_log_stats()
            await asyncio.sleep(0)  # let the loop breathe between steps

    def _launch(self, loop: asyncio.AbstractEventLoop, prepared) -> asyncio.Future:
        """Starts a step on the model thread (CUDA: queues it) -> the future of its results."""
        if self._chain is not None:
            return self._chain.start(prepared)
        if not self.core.launches_async:
            return loop.run_in_executor(self._model_thread, self.core.run, prepared)
        return loop.create_task(self._run_launched(loop, prepared))

    def _offer_next(self, step, prepared) -> None:
        """Async scheduling: offers the model thread the step after `step` (running now, from
        `prepared`), where it is known now (engine/continuation.py)."""
        try:
            continuation = self.core.plan_continuation(step)
            if continuation is None:
                return
            prepared = self.core.prepare_continuation(prepared, continuation.step)
        except Exception:  # the step after is then scheduled as usual; its slots stay allocated
            logger.exception("planning the next step ahead failed")
            return
        self._chain.offer(continuation.step, prepared, continuation.rows)

    async def _run_launched(self, loop: asyncio.AbstractEventLoop, prepared):
        if self._completion is None:
            self._completion = StepCompletion(loop)
        done = self._completion.arm()
        launched = await loop.run_in_executor(self._model_thread, self.core.launch, prepared,
                                              self._completion.fd)
        await done
        return self.core.finish(launched)

    def _maybe_log_stats(self) -> None:
        t = time.monotonic()
        if self._log_interval <= 0 or t - self._last_log < self._log_interval:
            return
        snap = self.core.snapshot()
        prompt, gen = snap["prompt_tokens_total"], snap["generation_tokens_total"]
        elapsed = t - self._last_log
        logger.info(
            "engine: %.1f prompt tok/s, %.1f generation tok/s, running %d, waiting %d, KV %.1f%%, "
            "prefix-cache hit rate %.1f%%, preemptions %d, loop busy %.1f%%",
            (prompt - self._last_tokens[0]) / elapsed, (gen - self._last_tokens[1]) / elapsed,
            snap["num_running"], snap["num_waiting"], 100 * snap["kv_usage"],
            100 * snap["prefix_cache_hit_rate"], snap["num_preemptions"], 100 * self.loop_busy_fraction)
        if self.core.config.scheduler.speculative_config is not None:
            stats = self.core.stats  # vLLM's SpecDecoding metrics line, over the whole run
            drafts, proposed, kept = stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens
            logger.info("speculative decoding: mean acceptance length %.2f, accepted %d of %d "
                        "draft tokens (%.1f%%), %d drafts", 1 + kept / drafts if drafts else 0.0,
                        kept, proposed, 100 * kept / proposed if proposed else 0.0, drafts)
        self._last_log, self._last_tokens = t, (prompt, gen)

    def _fail(self, step, exc: Exception) -> None:
        """Fails the step's requests; if even that fails, the engine is dead (every stream
        gets the error) rather than silently stuck."""
        try:
            for request_id in self.core.group_ids(step):
                self.core.abort(request_id, "errored")
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(EngineDeadError(f"engine step failed: {exc}"))
        except Exception as second:
            logger.exception("failing the step's requests failed")
            self._engine_died(f"{exc}; then {second}")

    @property
    def alive(self) -> bool:
        """The step loop is running (it stops only on shutdown or a crash)."""
        return self._task is not None and not self._task.done()

    def stalled(self, limit_s: float) -> bool:
        """Work is pending but no step has completed for limit_s seconds."""
        return self.core.has_unfinished() and time.monotonic() - self.last_progress > limit_s

    @property
    def loop_busy_fraction(self) -> float:
        total = self.loop_busy_s + self.model_wait_s
        return self.loop_busy_s / total if total else 0.0
