"""One step on the device: scheduled requests -> input tensors (prepare, on the event loop,
where request state lives) -> forward and sampling (run, safe to call from the model thread:
it touches only the prepared tensors, the model and the sampling requests' generators).

Under tensor parallelism every rank runs execute_model on the same ForwardInputs (rank 0
prepares them; the executor ships them to the others); only rank 0 gets logits and samples.
All the step's logits, sampled rows and prompt-logprob rows alike, come from one
compute_logits call, because that call is a collective every rank must make exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyserve.engine.scheduler import ScheduledRequest
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.sampler import (SamplerOutput, SamplingMetadata, build_metadata, read_result_table,
                                   sample, sample_on_device)


@dataclass
class PromptLogprobsRequest:
    """Rows of this step whose logits score the request's next prompt token."""

    request_id: str  # the client's (group) id
    rows: list[int]
    targets: list[int]
    k: int
    first_position: int  # prompt position of the first target


@dataclass
class PromptLogprobs:
    request_id: str
    first_position: int
    target_logprobs: list[float]
    target_ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class ForwardInputs:
    """What every tensor-parallel rank needs for the forward pass; host tensors."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64: rows of the hidden states that need logits

    def to(self, device: torch.device) -> ForwardInputs:
        if device.type == "cpu":
            return self
        move = lambda t: t.to(device, non_blocking=True)
        m = self.meta
        return ForwardInputs(move(self.input_ids), move(self.positions),
                             AttentionMetadata(move(m.slot_mapping), move(m.block_tables),
                                               move(m.query_start_loc), move(m.seq_lens)),
                             move(self.logits_rows))


@dataclass
class PreparedBatch:
    inputs: ForwardInputs
    num_sampled: int  # logits rows [0, num_sampled) are sampled, in batch order
    sampling: SamplingMetadata | None
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)


@dataclass
class StepResult:
    sampled: SamplerOutput | None
    prompt_logprobs: list[PromptLogprobs]


@dataclass
class LaunchedStep:
    """A step queued on the device; its results are readable once the stream has run it."""

    batch: PreparedBatch
    table: torch.Tensor | None  # pinned host memory the sampler's result table is copied into
    prompt_logprobs: list[PromptLogprobs]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, device: torch.device,
                 seed: int):
        self.model = model
        self.kv_caches = kv_caches
        self.num_blocks = kv_caches[0][0].shape[0] if kv_caches else 0
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.arch.vocab_size
        # for requests without a seed; on the device, so that their noise is drawn there
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.graphs = None  # DecodeGraphs, once captured (CUDA, without --enforce-eager)
        self._stream = None  # CUDA: the stream launch() queues steps on, made on first use

    def prepare(self, batch: list[ScheduledRequest]) -> PreparedBatch:
        bs = self.block_size
        input_ids, positions, slots, starts, seq_lens, sample_rows = [], [], [], [0], [], []
        prompt_lp = []
        max_blocks = max(len(s.request.block_ids) for s in batch)
        tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for row, s in enumerate(batch):
            r = s.request
            first, last = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            tokens = r.token_ids()
            input_ids.extend(tokens[first:last])
            positions.extend(range(first, last))
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(first, last))
            if r.params.prompt_logprobs is not None:
                scored = range(first, min(last, len(r.prompt_token_ids) - 1))
                if scored:
                    prompt_lp.append(PromptLogprobsRequest(
                        r.group_id, [starts[-1] + p - first for p in scored],
                        [r.prompt_token_ids[p + 1] for p in scored], r.params.prompt_logprobs,
                        scored.start + 1))
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(last)
            tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if s.samples:
                sample_rows.append(starts[-1] - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        )
        logits_rows = sample_rows + [row for p in prompt_lp for row in p.rows]
        inputs = ForwardInputs(torch.tensor(input_ids, dtype=torch.int64),
                               torch.tensor(positions, dtype=torch.int64), meta,
                               torch.tensor(logits_rows, dtype=torch.int64))
        sampling_requests = [s.request for s in batch if s.samples]
        return PreparedBatch(
            inputs, len(sample_rows),
            build_metadata(sampling_requests, self.vocab_size, self.device) if sampling_requests else None,
            prompt_lp)

    @torch.inference_mode()
    def execute_model(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """The forward pass -> float32 logits of inputs.logits_rows (None on ranks other than
        0, or when no row needs logits)."""
        size = self.graphs.bucket(inputs) if self.graphs is not None else None
        if size is not None:
            hidden = self.graphs.run(inputs, size)
            rows = inputs.logits_rows.to(self.device, non_blocking=True)
        else:
            inputs = inputs.to(self.device)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            rows = inputs.logits_rows
        if rows.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[rows])
        return None if logits is None else logits.float()

    @torch.inference_mode()
    def run(self, batch: PreparedBatch) -> StepResult:
        logits = self.execute_model(batch.inputs)
        sampled = None
        if batch.sampling is not None:
            sampled = sample(logits[: batch.num_sampled], batch.sampling, self.generator)
        return StepResult(sampled, self._prompt_logprobs(logits, batch))

    def _prompt_logprobs(self, logits: torch.Tensor, batch: PreparedBatch) -> list[PromptLogprobs]:
        prompt_logprobs, row = [], batch.num_sampled
        for request in batch.prompt_logprobs:
            n = len(request.rows)
            prompt_logprobs.append(_prompt_logprobs(logits[row: row + n], request))
            row += n
        return prompt_logprobs

    @torch.inference_mode()
    def launch(self, batch: PreparedBatch, notify) -> LaunchedStep:
        """CUDA: queues the step (forward, sampling, the copy of its result table to pinned
        host memory) on this runner's step stream, then notify() (a host-function write the
        event loop awaits), and returns without waiting for the device. Prompt-logprob rows,
        which few requests ask for, are read synchronously."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        # the batch's sampling tensors were copied in on the default stream, by the loop's thread
        self._stream.wait_stream(torch.cuda.default_stream(self.device))
        with torch.cuda.stream(self._stream):
            logits = self.execute_model(batch.inputs)
            table = None
            if batch.sampling is not None:
                on_device = sample_on_device(logits[: batch.num_sampled], batch.sampling, self.generator)
                table = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
                table.copy_(on_device, non_blocking=True)
            prompt_logprobs = self._prompt_logprobs(logits, batch)
            notify()
        return LaunchedStep(batch, table, prompt_logprobs)

    @staticmethod
    def finish(step: LaunchedStep) -> StepResult:
        """After launch()'s notification: the step's results, read from host memory."""
        sampled = None
        if step.table is not None:
            sampled = read_result_table(step.table, step.batch.sampling.max_num_logprobs)
        return StepResult(sampled, step.prompt_logprobs)


@torch.inference_mode()
def _prompt_logprobs(logits: torch.Tensor, req: PromptLogprobsRequest) -> PromptLogprobs:
    logprobs = logits.log_softmax(dim=-1)
    targets = torch.tensor(req.targets, device=logprobs.device)[:, None]
    picked = logprobs.gather(1, targets)
    ranks = (logprobs > picked).sum(dim=-1) + 1
    top = logprobs.topk(req.k, dim=-1) if req.k > 0 else None
    n = len(req.rows)
    return PromptLogprobs(req.request_id, req.first_position, picked[:, 0].tolist(), ranks.tolist(),
                          top.indices.tolist() if top else [[]] * n,
                          top.values.tolist() if top else [[]] * n)
