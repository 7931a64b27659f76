"""The engine core: owns the requests, the scheduler, the KV-cache accounting and the
tokenizer, and reaches the model only through its executor. One step, written once here and
used by the offline LLM (step()) and the async engine (begin_step, then the run awaited, then
end_step):

    schedule   Scheduler -> SchedulerOutput (plain data, pyserve/step.py)
    prepare    executor: input tensors, on the caller's thread
    run        executor: forward + sampling -> ModelRunnerOutput (may run on another thread)
    update     the scheduler advances num_computed_tokens; the output processor appends the
               tokens, checks stops, detokenizes and builds the outputs due

Start-up is resolved by executor/plan.py's resolve(config) without loading weights."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pyserve.config import Config
from pyserve.engine.admission import Admission, Limits, admit_pooling
from pyserve.engine.books import engine_books
from pyserve.engine.continuation import Continuation, plan_continuation
from pyserve.engine.faults import StepFault
from pyserve.engine.generation_defaults import load_generation_defaults
from pyserve.engine.output import RequestOutput
from pyserve.engine.output_processor import OutputProcessor
from pyserve.engine.pooling import pooling_state
from pyserve.engine.request_group import RequestGroup
from pyserve.engine.request_table import RequestTable
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.stats import EngineStats, now
from pyserve.errors import InvalidRequest
from pyserve.executor import executor_class
from pyserve.executor.plan import resolve, resolve_draft
from pyserve.kv.manager import KVCacheManager
from pyserve.kv.state import StatePool
from pyserve.pooling_params import PoolingParams
from pyserve.sampling_params import SamplingParams
from pyserve.step import ModelRunnerOutput, SchedulerOutput, dummy_lengths, dummy_step
from pyserve.structured.bitmask import allow_only, fill_bitmask
from pyserve.structured.compiler import GrammarCompiler, reasoning_markers
from pyserve.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger("pyserve")

WARMUP_TOKENS = 16


class EngineCore:
    def __init__(self, config: Config):
        t0 = time.perf_counter()
        plan = resolve(config)
        self.plan = plan
        self.config = config = plan.config
        self.device = torch.device(plan.device)
        self.dtype = plan.shard.dtype  # activations (the KV cache: plan.shard.cache_dtype)
        self.model_name = plan.model_name
        self.model_path = plan.model_path
        self.vocab_size = plan.vocab_size
        self.max_model_len = plan.max_model_len
        self.pooler = plan.pooler  # how /v1/embeddings pools this model
        self.is_encoder = plan.is_encoder  # an embedding-only model (bidirectional attention)
        self.tokenizer = load_tokenizer(plan.tokenizer_path)
        eos = set(plan.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        # what a request (or LLM.generate without SamplingParams) leaves out
        self.generation_defaults = load_generation_defaults(
            config.model.generation_config, plan.model_path, config.model.override_generation_config)
        torch.manual_seed(config.model.seed)
        draft = resolve_draft(plan)  # before the target loads: a bad draft fails fast
        self.executor = executor_class(config.parallel)(plan.shard)
        num_blocks = self.executor.num_blocks
        if draft is not None:
            t_draft = time.perf_counter()
            self.executor.attach_draft_model(dataclasses.replace(draft, num_blocks=num_blocks))
            logger.info("draft model %s (%s, %d layers) loaded in %.2fs, its KV cache beside the "
                        "target's (%d blocks)", draft.path, draft.arch.architecture,
                        draft.arch.num_layers, time.perf_counter() - t_draft, num_blocks)
        tp = config.parallel.tensor_parallel_size
        logger.info("loaded %s (%s, %s, %s) in %.2fs; executor: %s, tensor-parallel size %d",
                    plan.architecture, plan.model_path, plan.weights, self.device,
                    time.perf_counter() - t0, self.executor.description, tp)
        bs = plan.block_size
        logger.info("KV cache%s (%s): %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes/block); "
                    "max concurrency at %d tokens: %.1fx; block order: %s",
                    " per rank" if tp > 1 else "", str(plan.shard.cache_dtype).removeprefix("torch."),
                    num_blocks, bs, num_blocks * bs,
                    num_blocks * plan.bytes_per_block / 1024**3, plan.bytes_per_block,
                    self.max_model_len, num_blocks / plan.blocks_per_sequence, plan.block_order)
        groups = plan.kv_groups
        if groups is not None:
            logger.info("KV cache layout: hybrid, %d groups of %d layers (%s); blocks of a "
                        "sliding group that fall out of its window go back to the pool "
                        "(--disable-hybrid-kv-cache-manager keeps them)", groups.num_groups,
                        groups.group_size, ", ".join(
                            "global" if w is None else f"window {w}" for w in groups.windows))
        self.kv_bytes_per_block = plan.bytes_per_block  # one rank's
        pool = plan.state_pool
        state = StatePool(pool.slots, pool.checkpoints, bs, pool.interval) if pool.slots else None
        self.kv = KVCacheManager(num_blocks, bs, config.cache.enable_prefix_caching, plan.block_order,
                                 groups, state)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        spec = config.scheduler.speculative_config
        if spec is not None:
            logger.info("speculative decoding: %s, up to %d draft tokens a step%s%s", spec.method,
                        spec.num_speculative_tokens,
                        f" (lookup {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens)"
                        if spec.method == "ngram" else f" from {spec.model}",
                        "" if spec.disable_by_batch_size is None else
                        f", none while more than {spec.disable_by_batch_size} requests run "
                        "(disable_by_batch_size)")
        self.requests = RequestTable()
        # structured outputs: xgrammar and the vocabulary are read on the first grammar only
        self.grammars = GrammarCompiler(self.tokenizer, plan.vocab_size, tuple(sorted(eos)))
        self.admission = Admission(
            Limits(plan.vocab_size, self.max_model_len, num_blocks, bs, config.model.max_logprobs,
                   config.scheduler.scheduling_policy == "priority", groups,
                   config.scheduler.max_num_batched_tokens),
            tuple(sorted(eos)), self.tokenizer, staged_siblings=self.kv.enable_prefix_caching,
            grammars=self.grammars, reasoning_markers=reasoning_markers(
                self.tokenizer, config.server.reasoning_parser))
        self.stats = EngineStats(self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.stats)
        self.async_scheduling = self._resolve_async_scheduling()
        fault_step = config.scheduler.test_fault_step
        self.fault = None if fault_step is None else StepFault(fault_step)  # tests only
        if self.fault is not None:
            logger.warning("test fault injection is on: model step %d will fail", fault_step)

    def _resolve_async_scheduling(self) -> bool:
        """--async-scheduling (default: on where it can run): the model thread goes from a
        decode step straight into the next (engine/step_chain.py). It runs where steps run
        synchronously in this process (the CPU, one rank) without speculative decoding."""
        asked = self.config.scheduler.async_scheduling
        why_not = None
        if self.device.type != "cpu":
            why_not = ("it runs on the CPU only (CUDA steps are queued on a stream and awaited "
                       "without a blocked thread)")
        elif not self.executor.chains_steps:
            why_not = f"the {self.executor.description} executor runs each step as scheduled"
        elif self.config.scheduler.speculative_config is not None:
            why_not = "speculative decoding proposes each step's drafts from the last one's tokens"
        if why_not is not None:
            if asked:
                logger.warning("--async-scheduling is off: %s", why_not)
            return False
        return asked is not False

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.admission.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: tuple[int, ...]) -> None:
        self.admission.eos_token_ids = ids

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> RequestGroup:
        """Admits a request (n completions) or raises InvalidRequest saying why it can never run."""
        if request_id in self.requests:
            raise InvalidRequest(None, f"request_id '{request_id}' is already in use")
        group = self.admission.admit(request_id, prompt_token_ids, params, prompt, priority)
        self.requests.add(group)
        for child in group.children:
            if child not in group.pending:
                self.scheduler.add(child)
        return group

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int],
                            params: PoolingParams, prompt: str | None = None,
                            priority: int = 0) -> RequestGroup:
        """Admits a pooling (embedding) request, or raises InvalidRequest; its one output
        carries the pooled tensor (engine/pooling.py)."""
        if request_id in self.requests:
            raise InvalidRequest(None, f"request_id '{request_id}' is already in use")
        group = self._pooling_group(request_id, prompt_token_ids, params, prompt, priority)
        self.requests.add(group)
        self.scheduler.add(group.children[0])
        return group

    def check_pooling_request(self, prompt_token_ids: list[int], params: PoolingParams,
                              priority: int = 0) -> None:
        """Raises InvalidRequest where add_pooling_request would, adding nothing: a batch of
        inputs fed to the engine a window at a time is refused before its first one runs."""
        self._pooling_group("", prompt_token_ids, params, None, priority)

    def _pooling_group(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                       prompt: str | None, priority: int) -> RequestGroup:
        if self.config.parallel.pipeline_parallel_size > 1:
            # the final hidden states stay on the last stage; only the logits come back
            raise InvalidRequest(None, "embeddings (pooling) are not served under "
                                 "--pipeline-parallel-size > 1")
        state = pooling_state(params, self.pooler, self.plan.hidden_size, self.is_encoder)
        return admit_pooling(self.admission.limits, request_id, prompt_token_ids, state,
                             self.admission.next_arrival(), prompt, priority)

    def abort(self, request_id: str, outcome: str = "aborted") -> None:
        """Ends the request, if it is still known, by outcome: "aborted" or "errored"."""
        group = self.requests.remove(request_id, outcome)
        if group is None:
            return
        group.pending = []
        for child in group.children:
            if not child.finished:
                child.finish("abort")  # not a finished request in the stats, as in vLLM
                self.scheduler.finish(child)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def get_tokenizer(self):
        """vLLM's LLMEngine.get_tokenizer()."""
        return self.tokenizer

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = self.scheduler.schedule()
        t = now()
        matchers, row = {}, 0  # sampled row -> the grammar constraining it
        forced = {}  # sampled row -> the one token it may be (a spent thinking budget)
        for seq in step.sequences:
            request = self.requests.child(seq.request_id)
            self.stats.on_scheduled(request, t)
            if seq.sampling is not None:
                if (request.matcher is not None and request.grammar_after is None
                        and not request.matcher.is_terminated()):
                    matchers[row] = request.matcher
                token = request.thinking.forced_token() if request.thinking is not None else None
                if token is not None:
                    forced[row] = token
                row += 1
        if matchers or forced:
            step.grammar_bitmask = fill_bitmask(matchers, row, self.vocab_size)
            for forced_row, token in forced.items():
                allow_only(step.grammar_bitmask, forced_row, token)
            step.constrained_rows = sorted(matchers.keys() | forced.keys())
        self._draft_masks(step)
        return step

    def _draft_masks(self, step: SchedulerOutput) -> None:
        """Grammar masks for the drafts rows of constrained requests: a fork of the request's
        matcher walks its drafts, filling each row's mask before taking the next draft. A
        draft the grammar refuses is masked out of its own row, so verification rejects it
        there and the rows after it are never read. A draft model's drafts do not exist yet:
        its sequence takes the fork along, and the proposer walks it (model/draft_model.py)."""
        rows, row = {}, 0
        for seq in step.sequences:
            if not seq.draft_token_ids:
                continue
            matcher = self.requests.child(seq.request_id).matcher
            constrained = matcher is not None and not matcher.is_terminated()
            if constrained and seq.draft_context is not None:  # a draft model's placeholders
                seq.draft_grammar = matcher.fork()
            elif constrained:
                walker = matcher.fork()
                for i in range(len(seq.draft_token_ids) + 1):
                    rows[row + i] = walker.fork()  # the state after the first i drafts
                    if (i == len(seq.draft_token_ids) or not walker.accept_token(seq.draft_token_ids[i])
                            or walker.is_terminated()):
                        break
            row += len(seq.draft_token_ids) + 1
        if rows:
            step.draft_bitmask = fill_bitmask(rows, row, self.vocab_size)
            step.draft_constrained_rows = sorted(rows)

    def prepare(self, step: SchedulerOutput):
        return self.executor.prepare(step)

    def run(self, prepared) -> ModelRunnerOutput:
        """Forward and sampling; the one phase that may run off the caller's thread."""
        if self.fault is not None:
            self.fault.before_step()
        return self.executor.execute(prepared)

    @property
    def launches_async(self) -> bool:
        return self.executor.launches_async

    def launch(self, prepared, notify_fd: int):
        """CUDA: queues the step; notify_fd (an eventfd) is written when it is done."""
        if self.fault is not None:
            self.fault.before_step()
        return self.executor.launch(prepared, notify_fd)

    def finish(self, launched) -> ModelRunnerOutput:
        return self.executor.finish(launched)

    def plan_continuation(self, step: SchedulerOutput) -> Continuation | None:
        """Async scheduling: the step after `step` (running now), where it is known before
        step's tokens are (engine/continuation.py)."""
        return plan_continuation(step, self.requests, self.scheduler, self.max_model_len)

    def prepare_continuation(self, previous, step: SchedulerOutput):
        """The continuation's batch, built from the running step's where it can be."""
        return self.executor.prepare_continuation(previous, step)

    def begin_step(self):
        """(the step, its prepared batch), or None when nothing can run this instant."""
        step = self.schedule()
        if not step.sequences:
            return None
        return step, self.prepare(step)

    def update(self, step: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        """Applies a step's results; returns the outputs due (per each request's output_kind).
        Requests aborted while the step ran are skipped: their blocks are already free."""
        self.outputs.record_prompt_logprobs(result.prompt_logprobs, self.requests)
        sampled = result.sampled
        pooled = {chunk.request_id: chunk.data for chunk in result.pooled}
        verified = iter(zip(result.verified, result.verified_logprobs))
        row = 0
        t = now()
        outputs = []
        for seq in step.sequences:
            token = None
            if seq.sampling is not None:
                token, lp_row = sampled.token_ids[row], row
                row += 1
            tokens, logprobs = next(verified) if seq.draft_token_ids else (None, None)
            request = self.requests.child(seq.request_id)
            if request is None or request.finished:
                continue
            if tokens is not None:
                output = self._speculated(request, seq.draft_token_ids, tokens, logprobs, t)
                if output is not None:
                    outputs.append(output)
                continue
            self.scheduler.computed(request, seq.num_new_tokens)
            if seq.pooling is not None:
                output = self._pooled(request, seq.start, pooled.get(seq.request_id), t)
                if output is not None:
                    outputs.append(output)
                continue
            group = self.requests.group_of(request)
            self._release_siblings(group)
            if token is None:
                continue
            self.outputs.add_token(request, token, sampled.logprobs, lp_row, t)
            output = self._advanced(group, request)
            if output is not None:
                outputs.append(output)
        self.stats.on_step_done()
        return outputs

    def _advanced(self, group: RequestGroup, request) -> RequestOutput | None:
        """After a request took its step's tokens: its end, its group's end, its output."""
        if request.finished:
            self.scheduler.finish(request)
            self._release_siblings(group)
        output = self.outputs.output(group, request)
        if group.finished:
            self.stats.on_group_finished(group.children)
            self.requests.remove(group.request_id, "finished")
        return output

    def _speculated(self, request, drafts: list[int], tokens: list[int], logprobs, t: float):
        """A verified step: its tokens (accepted drafts, then the target's own) are appended
        until one ends the request; num_computed_tokens advances over the last token before
        the step and the accepted drafts appended (their K/V are right), not past them."""
        appended = 0
        for row, token in enumerate(tokens):
            self.outputs.add_token(request, token, logprobs, row, t)
            appended += 1
            if request.finished:
                break
        self.scheduler.computed(request, 1 + min(appended, len(tokens) - 1))
        self.stats.on_speculated(len(drafts), len(tokens) - 1)
        self.scheduler.verified(request, len(drafts), len(tokens) - 1)
        group = self.requests.group_of(request)
        self._release_siblings(group)
        return self._advanced(group, request)

    def _pooled(self, request, start: int, part, t: float) -> RequestOutput | None:
        """A pooling request's chunk; at its last, the request ends with its result."""
        state = request.pooling
        if start == 0:  # its first chunk, or its first again after a preemption
            state.restart()
        state.add(part)
        if request.num_computed_tokens < request.num_tokens:
            return None
        request.finish("stop")
        self.scheduler.finish(request)
        self.requests.remove(request.group_id, "finished")
        self.stats.on_pooled(request, t)
        return RequestOutput(request.group_id, request.prompt, request.prompt_token_ids, [],
                             finished=True, num_cached_tokens=request.num_cached_tokens,
                             pooled=state.result(request.num_tokens))

    def group_ids(self, step: SchedulerOutput) -> set[str]:
        """The client requests (groups) a step's sequences belong to, those still known."""
        children = (self.requests.child(seq.request_id) for seq in step.sequences)
        return {child.group_id for child in children if child is not None}

    def _release_siblings(self, group: RequestGroup) -> None:
        for sibling in group.release_pending():
            self.scheduler.add(sibling)

    def step(self) -> list[RequestOutput]:
        begun = self.begin_step()
        if begun is None:
            return []
        step, prepared = begun
        return self.update(step, self.run(prepared))

    # -- start-up, figures, shutdown -------------------------------------------------------------
    def warmup_tokens(self) -> int:
        """Tokens in the start-up warm-up forward: one for each of a few sequences is enough
        (every kernel and the engine's step path run once, the packed linear kernel over more
        than one row tile, the thread pool starts; 256 tokens cost 0.4 s of start-up and warmed
        nothing more). On CUDA the KV cache was already sized by the profiling forward at
        --max-num-batched-tokens while the model loaded (kv/memory.py), so no full step here."""
        return min(self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs,
                   WARMUP_TOKENS)

    def profile_run(self, num_tokens: int | None = None) -> float:
        """One forward pass over num_tokens (default: --max-num-batched-tokens) of dummy
        prompts (pyserve/step.py's dummy step), on blocks borrowed from the pool and returned;
        returns its seconds."""
        sched = self.config.scheduler
        lengths = dummy_lengths(num_tokens or sched.max_num_batched_tokens, sched.max_num_seqs,
                                self.max_model_len)
        ids = []
        try:
            for i, n in enumerate(lengths):
                if not self.kv.allocate_slots(f"profile-{i}", n):
                    break
                ids.append(f"profile-{i}")
            if not ids:
                return 0.0
            return self.executor.profile_run(
                dummy_step(lengths[:len(ids)], [self.kv.block_ids(i) for i in ids], self.is_encoder,
                           [self.kv.group_block_ids(i) for i in ids]))
        finally:
            for i in ids:
                self.kv.forget(i)

    def on_executor_failure(self, callback) -> None:
        """callback(reason), from another thread, when a tensor-parallel worker dies."""
        self.executor.on_failure(callback)

    def shutdown(self) -> None:
        """Stops the worker processes, if any. The engine cannot step afterwards."""
        self.executor.shutdown()

    def books(self, count_references: bool = False) -> dict:
        """Requests accepted and ended, and the per-request state left (engine/books.py)."""
        return engine_books(self, count_references)

    def snapshot(self) -> dict:
        """The figures a server exposes: queue sizes, cache use, totals and latencies."""
        kv, st = self.kv, self.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_usage": 1.0 - kv.num_free_blocks / kv.num_blocks,
            # linear-attention layers: the state pool's running rows in use (kv/state.py)
            "state_usage": (1.0 - kv.state.num_free_slots / kv.state.num_slots) if kv.state else None,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": st.prompt_tokens,
            "generation_tokens_total": st.generation_tokens,
            "finished_requests": st.finished_requests,
            **st.summary(),
        }
