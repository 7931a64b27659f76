"""The engine core: owns the model, the KV cache, the scheduler and the tokenizer, and runs
one step at a time: schedule -> prepare -> run (forward + sample) -> process (update requests,
detokenize, stop checks, outputs). Only run() may happen off the caller's thread; the async
engine runs it in its model thread, the offline LLM calls step()."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from pyserve import _native
from pyserve.config import Config, SchedulerConfig
from pyserve.engine.generation_defaults import load_generation_defaults
from pyserve.engine.output import Logprob, RequestOutput
from pyserve.engine.request import Request
from pyserve.engine.request_group import RequestGroup
from pyserve.engine.sampling_params import SamplingParams
from pyserve.engine.scheduler import ScheduledRequest, Scheduler
from pyserve.engine.stats import EngineStats, now
from pyserve.engine.stop import append_token
from pyserve.executor import executor_class
from pyserve.executor.shard import ShardSpec, check_tensor_parallel
from pyserve.kv.cache import DEFAULT_CPU_KV_CACHE_BYTES, bytes_per_block
from pyserve.kv.manager import KVCacheManager
from pyserve.model.errors import ModelLoadError
from pyserve.model.layers.parallel import kv_heads_per_rank
from pyserve.model.cuda_graphs import capture_sizes
from pyserve.model.loader import resolve_dtype
from pyserve.model.runner import LaunchedStep, ModelRunner, PreparedBatch, StepResult
from pyserve.model.source import resolve_model
from pyserve.tokenizer.detokenizer import IncrementalDetokenizer
from pyserve.tokenizer.tokenizer import load_tokenizer

logger = logging.getLogger("pyserve")

WARMUP_TOKENS = 16
CUDA_HEAD_SIZES = (64, 128, 256)  # csrc/cuda/attention.cu's instantiations


def resolve_device(name: str) -> torch.device:
    """auto: CUDA where torch sees a device and pyserve._C has CUDA kernels, else the CPU."""
    cuda_ready = torch.cuda.is_available() and _native.built_with_cuda()
    if name == "auto":
        return torch.device("cuda" if cuda_ready else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: this torch sees no CUDA device")
    if name == "cuda" and not cuda_ready:
        raise ModelLoadError("--device cuda: this build of pyserve._C has no CUDA kernels (it was "
                             "built without nvcc or against a CPU torch); rebuild it, or use --device cpu")
    return torch.device(name)


def resolve_max_model_len(requested: int | None, arch) -> int:
    limit = arch.max_position_embeddings
    if requested is not None and requested > limit:
        raise ModelLoadError(f"--max-model-len {requested} exceeds the model's "
                             f"max_position_embeddings ({limit})")
    length = requested or limit
    if arch.sliding_window is not None and arch.sliding_window < length:
        logger.warning("sliding-window attention is not implemented; capping --max-model-len "
                       "at the window, %d tokens", arch.sliding_window)
        length = arch.sliding_window
    return length


def _int8_activations(requested: str) -> bool:
    if requested != "int8":
        return False
    if not _native.int8_dot_supported():
        logger.warning("--gguf-activations int8 needs a CPU with AVX-512 VNNI (and an extension "
                       "built on one); using float32 activations")
        return False
    return True


def _dtype_name(dtype: torch.dtype, weight_dtype: torch.dtype) -> str:
    name = lambda d: str(d).removeprefix("torch.")
    if weight_dtype == dtype:
        return name(dtype)
    return f"{name(weight_dtype)} weights, {name(dtype)} activations"


# (max_num_seqs, max_num_batched_tokens) by device type, where not given
STEP_LIMITS = {"cpu": (128, 128), "cuda": (256, 2048)}


def resolve_step_limits(scheduler: SchedulerConfig, device: torch.device) -> SchedulerConfig:
    """Fills in --max-num-seqs and --max-num-batched-tokens where they were not given.

    On the CPU a step's time grows with its tokens: a 512-token step takes half a second, and
    every request in it (each running decode too) waits for all of it. Steps of 128 tokens gave
    the same throughput with lower median times to first token (python -m benchmarks.serve,
    W2: 931 against 1,703 ms; W4 with prefix caching: 1,110 against 2,124 ms), and a lone
    2,000-token prompt its first token 2 % later. A GPU step costs about the same at 2,048
    tokens as at 512. The budget is kept at least max_num_seqs, so that every running sequence
    gets its token each step; a given budget below the default sequence count caps that."""
    seqs_default, budget_default = STEP_LIMITS["cuda" if device.type == "cuda" else "cpu"]
    seqs, budget = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    if seqs is None:
        seqs = seqs_default if budget is None else min(seqs_default, budget)
    if budget is None:
        budget = max(budget_default, seqs)
    return dataclasses.replace(scheduler, max_num_seqs=seqs, max_num_batched_tokens=budget)


class EngineCore:
    def __init__(self, config: Config):
        t0 = time.perf_counter()
        self.device = resolve_device(config.device.device)
        config = dataclasses.replace(config, scheduler=resolve_step_limits(config.scheduler, self.device))
        self.config = config
        source = resolve_model(config.model)
        self.model_name = source.name
        self.model_path = source.path
        self.arch = arch = source.arch
        self.dtype, self.weight_dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, self.device)
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
        self.tokenizer = load_tokenizer(source.tokenizer_path)
        self.eos_token_ids = self._eos_ids(source)
        # what a request (or LLM.generate without SamplingParams) leaves out
        self.generation_defaults = load_generation_defaults(config.model.generation_config, source.path)
        tp = config.parallel.tensor_parallel_size
        check_tensor_parallel(arch, tp)
        if self.device.type == "cuda" and arch.head_dim not in CUDA_HEAD_SIZES:
            raise ModelLoadError(f"head_dim {arch.head_dim} is not supported on CUDA (the attention "
                                 f"kernel has head sizes {', '.join(map(str, CUDA_HEAD_SIZES))}); "
                                 "use --device cpu")
        executor_cls = executor_class(config.parallel)
        torch.manual_seed(config.model.seed)

        block_size = config.cache.block_size
        per_block = bytes_per_block(arch, kv_heads_per_rank(arch.num_kv_heads, tp), block_size, self.dtype)
        need = -(-self.max_model_len // block_size)
        num_blocks = None  # CUDA without --kv-cache-memory: measured after loading (kv/memory.py)
        if self.device.type == "cpu" or config.cache.kv_cache_memory is not None:
            budget = config.cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // per_block
            if num_blocks < need:
                raise ModelLoadError(
                    f"the KV cache ({budget} bytes = {num_blocks} blocks of {block_size} tokens) cannot "
                    f"hold one sequence of --max-model-len {self.max_model_len} ({need} blocks); raise "
                    "--kv-cache-memory or lower --max-model-len")
        sched = config.scheduler
        graph_sizes = ()
        if self.device.type == "cuda" and not config.device.enforce_eager:
            graph_sizes = capture_sizes(config.device.cuda_graph_sizes, sched.max_num_seqs)
        gguf_kept = source.gguf_path is not None and self.device.type == "cpu" and self.dtype == torch.float32
        int8_activations = gguf_kept and _int8_activations(config.model.gguf_activations)
        spec = ShardSpec(arch, source.path, config.model.load_format, self.dtype, self.device.type,
                         self.max_model_len, config.model.seed, block_size, num_blocks, tp,
                         self.weight_dtype, source.gguf_path, config.cache.gpu_memory_utilization,
                         sched.max_num_batched_tokens, sched.max_num_seqs, graph_sizes, int8_activations)
        self.executor = executor_cls(spec, config.scheduler.max_num_batched_tokens)
        num_blocks = self.executor.runner.num_blocks
        activations = "int8 activations" if int8_activations else "float32 activations"
        weights = (f"GGUF weights from {source.gguf_path.name}, {activations}" if gguf_kept
                   else _dtype_name(self.dtype, self.weight_dtype))
        logger.info("loaded %s (%s, %s, %s) in %.2fs; executor: %s, tensor-parallel size %d",
                    arch.architecture, source.path, weights,
                    self.device, time.perf_counter() - t0, self.executor.description, tp)
        block_order = config.cache.kv_block_order
        if block_order == "auto":
            block_order = "lru" if self.device.type == "cuda" else "resident"
        logger.info("KV cache%s: %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes/block); "
                    "max concurrency at %d tokens: %.1fx; block order: %s",
                    " per rank" if tp > 1 else "", num_blocks, block_size, num_blocks * block_size,
                    num_blocks * per_block / 1024**3, per_block, self.max_model_len,
                    num_blocks / need, block_order)
        self.kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, block_order)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = self.executor.runner
        self._arrivals = itertools.count()
        self._groups: dict[str, RequestGroup] = {}
        self.stats = EngineStats()

    def _eos_ids(self, source) -> tuple[int, ...]:
        ids = set(source.arch.eos_token_ids)
        gen_file = source.path / "generation_config.json"
        if gen_file.exists():
            import json

            eos = json.loads(gen_file.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _check_admissible(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raises ValueError naming what makes the request impossible; returns its max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        vocab = self.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if n >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, your prompt has {n} tokens. Please shorten the prompt.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, you requested {n + max_tokens} tokens ({n} in the messages, "
                             f"{max_tokens} in the completion). Please reduce the length of the "
                             "messages or completion (max_tokens).")
        if self.kv.blocks_for(n + max_tokens) > self.kv.num_blocks:
            raise ValueError(f"{n + max_tokens} tokens cannot fit in the whole KV cache "
                             f"({self.kv.num_blocks * self.kv.block_size} tokens)")
        if any(not 0 <= t < vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias contains out-of-vocab token ids. Vocabulary size: {vocab}")
        limit = self.config.model.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"{name} must be at most {limit} (--max-logprobs), got {value}")
        return max_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> RequestGroup:
        """Admits a request (n completions) or raises ValueError saying why it can never run."""
        if request_id in self._groups:
            raise ValueError(f"request_id '{request_id}' is already in use")
        max_tokens = self._check_admissible(prompt_token_ids, params)
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} was given, but priority scheduling is not "
                             "enabled (--scheduling-policy priority)")
        children = []
        for index in range(params.n):
            child_params = RequestGroup.child_params(params, index)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child = Request(child_id, prompt_token_ids, child_params, self.eos_token_ids,
                            max_tokens, prompt=prompt, arrival=next(self._arrivals),
                            priority=priority)
            child.group_id, child.child_index = request_id, index
            child.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop_strings,
                params.include_stop_str_in_output)
            children.append(child)
        group = RequestGroup(request_id, children, staged=self.kv.enable_prefix_caching)
        self._groups[request_id] = group
        for child in children:
            if child not in group.pending:
                self.scheduler.add(child)
        return group

    def abort(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        group.pending = []
        for child in group.children:
            if not child.finished:
                child.finish("abort")
                self.stats.on_finished(child, now())
                self.scheduler.finish(child)

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
        prompts, spread over up to --max-num-seqs sequences (the start-up profiling and warm-up
        run); returns its seconds. Blocks are borrowed from the pool and returned."""
        budget = num_tokens or self.config.scheduler.max_num_batched_tokens
        # spread over as many sequences as a step may hold, as vLLM's dummy run does
        num_seqs = min(self.config.scheduler.max_num_seqs, budget)
        per_seq = min(-(-budget // num_seqs), self.max_model_len - 1)
        dummies, batch, left = [], [], budget
        while left > 0 and self.kv.num_free_blocks >= self.kv.blocks_for(per_seq):
            n = min(per_seq, left)
            r = Request(f"profile-{len(dummies)}", [0] * n, SamplingParams(temperature=0.0, max_tokens=1),
                        (), 1)
            self.kv.allocate_slots(r, n)
            dummies.append(r)
            batch.append(ScheduledRequest(r, n))
            left -= n
        start = time.perf_counter()
        try:
            if batch:
                self.run(self.prepare(batch))
        finally:
            for r in dummies:
                self.kv.free(r)
        return time.perf_counter() - start

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def schedule(self) -> list[ScheduledRequest]:
        batch = self.scheduler.schedule()
        t = now()
        for s in batch:
            self.stats.on_scheduled(s.request, t)
        return batch

    def prepare(self, batch: list[ScheduledRequest]) -> PreparedBatch:
        return self.runner.prepare(batch)

    def run(self, prepared: PreparedBatch) -> StepResult:
        return self.executor.execute(prepared)

    @property
    def launches_async(self) -> bool:
        """CUDA: steps can be queued (launch) and awaited without a blocked thread (finish)."""
        return self.device.type == "cuda" and _native.notify_when_done is not None

    def launch(self, prepared: PreparedBatch, notify_fd: int) -> LaunchedStep:
        """Queues the step on the device; notify_fd (an eventfd) is written when it is done.
        May run off the caller's thread, like run()."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return self.executor.launch(prepared, lambda: _native.notify_when_done(notify_fd, index))

    def finish(self, launched: LaunchedStep) -> StepResult:
        return ModelRunner.finish(launched)

    def on_executor_failure(self, callback) -> None:
        """callback(reason), from another thread, when a tensor-parallel worker dies."""
        self.executor.on_failure(callback)

    def shutdown(self) -> None:
        """Stops the worker processes, if any. The engine cannot step afterwards."""
        self.executor.shutdown()

    def process(self, batch: list[ScheduledRequest], result: StepResult) -> list[RequestOutput]:
        """Applies a step's results; returns the outputs due (per each request's output_kind).
        Requests aborted while the step ran are skipped: their blocks are already free."""
        self._record_prompt_logprobs(result.prompt_logprobs)
        sampled = result.sampled
        row = 0
        t = now()
        outputs = []
        for s in batch:
            request = s.request
            if s.samples:
                token, lp_row = sampled.token_ids[row], row
                row += 1
            else:
                token = None
            if request.finished:
                continue
            request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(request)
            group = self._groups[request.group_id]
            for sibling in group.release_pending():
                self.scheduler.add(sibling)
            if token is None:
                continue
            if request.logprobs is not None:
                request.logprobs.append(_position_logprobs(sampled.logprobs, lp_row, token,
                                                           request.params.logprobs))
            append_token(request, token, self.max_model_len)
            self.stats.on_token(request, t)
            if request.finished:
                self.stats.on_finished(request, t)
                self.scheduler.finish(request)
                for sibling in group.release_pending():
                    self.scheduler.add(sibling)
            output = group.output(request, self.tokenizer)
            if group.finished:
                del self._groups[group.request_id]
            if output is not None:
                outputs.append(output)
        return outputs

    def _record_prompt_logprobs(self, results) -> None:
        for r in results:
            group = self._groups.get(r.request_id)
            if group is None or group.prompt_logprobs is None:
                continue
            prompt = group.children[0].prompt_token_ids
            for i, value in enumerate(r.target_logprobs):
                position = r.first_position + i
                if position != len(group.prompt_logprobs):  # recomputed after a preemption
                    continue
                entry = {prompt[position]: Logprob(value, r.target_ranks[i])}
                for rank, (token, alt) in enumerate(zip(r.top_ids[i], r.top_logprobs[i]), 1):
                    entry.setdefault(token, Logprob(alt, rank))
                group.prompt_logprobs.append(entry)

    def snapshot(self) -> dict:
        """The figures a server exposes: queue sizes, cache use, totals and latencies."""
        kv, st = self.kv, self.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_usage": 1.0 - kv.num_free_blocks / kv.num_blocks,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": st.prompt_tokens,
            "generation_tokens_total": st.generation_tokens,
            "finished_requests": st.finished_requests,
            **st.summary(),
        }

    def step(self) -> list[RequestOutput]:
        batch = self.schedule()
        if not batch:
            return []
        return self.process(batch, self.run(self.prepare(batch)))


def _position_logprobs(sampled, row: int, token: int, k: int) -> dict:
    """The chosen token first, then the top-k alternatives, each with its rank."""
    entry = {token: Logprob(sampled.token_logprobs[row], sampled.token_ranks[row])}
    for rank, (alt, value) in enumerate(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]), 1):
        entry.setdefault(alt, Logprob(value, rank))
    return entry
