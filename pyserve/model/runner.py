"""One step on the device: a SchedulerOutput (plain data, pyserve/step.py) -> input tensors
(prepare, on the event loop) -> forward and sampling (run, safe to call from the model thread:
it touches only the prepared tensors, the model and the seeded requests' generators) -> a
ModelRunnerOutput. The runner never sees a request object; what it keeps per request (a
seeded request's generator) is keyed by request id and dropped when the request ends.

Under tensor parallelism every rank runs execute_model on the same ForwardInputs (rank 0
prepares them; the executor ships them to the others); only rank 0 gets logits and samples.
All the step's logits, sampled rows and prompt-logprob rows alike, come from one
compute_logits call, because that call is a collective every rank must make exactly once."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyserve.kv.residency import resident_bytes
from pyserve.model.layers.attention import AttentionMetadata
from pyserve.model.pooler import PoolingRows, pool_step
from pyserve.model.verify import verify, verify_on_device
from pyserve.model.sampler import (SamplingMetadata, build_metadata, logprob_columns,
                                   read_result_table, sample, sample_on_device)
from pyserve.step import ModelRunnerOutput, PromptLogprobs, SchedulerOutput


@dataclass
class PromptLogprobsRequest:
    """Rows of this step whose logits score the request's next prompt token."""

    request_id: str
    rows: list[int]
    targets: list[int]
    k: int
    first_position: int  # prompt position of the first target


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
        if m.group_block_tables is None:
            meta = AttentionMetadata(move(m.slot_mapping), move(m.block_tables),
                                     move(m.query_start_loc), move(m.seq_lens))
        else:
            slots, tables = move(m.group_slot_mapping), move(m.group_block_tables)
            meta = AttentionMetadata(slots[0], tables[0], move(m.query_start_loc),
                                     move(m.seq_lens), slots, tables)
        # read on the host
        meta.state_slots, meta.state_fresh = m.state_slots, m.state_fresh
        meta.state_copy_in, meta.state_copy_out = m.state_copy_in, m.state_copy_out
        return ForwardInputs(move(self.input_ids), move(self.positions), meta,
                             move(self.logits_rows))


@dataclass
class DraftModelRequest:
    """A sequence whose drafts a draft model proposes (model/draft_model.py) before the step
    runs: what its KV cache lacks of the request's tokens, and where the drafts go."""

    request_id: str
    context: list[int]  # the request's tokens from context_start through its last known one
    context_start: int
    block_ids: list[int]
    drafts_index: int  # into PreparedBatch.drafts
    first_row: int  # of the drafts in inputs.input_ids
    verify_row: int = 0  # its first row among the drafts rows (PreparedBatch.draft_grammar's)
    grammar: object | None = None  # a fork of its matcher (ScheduledSequence.draft_grammar)


@dataclass
class PreparedBatch:
    inputs: ForwardInputs
    num_sampled: int  # logits rows [0, num_sampled) are sampled, in batch order
    sampling: SamplingMetadata | None
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    pooling: list[PoolingRows] = field(default_factory=list)  # pooled, never sampled
    # speculative decoding: each sequence's drafts, verified on the logits rows after the
    # sampled and prompt-logprob ones, len(drafts) + 1 rows each, in this order
    drafts: list[list[int]] = field(default_factory=list)
    draft_sampled: list[int] = field(default_factory=list)  # which drafts' requests sample
    draft_sampling: SamplingMetadata | None = None  # over those requests' rows, in order
    draft_logprobs: int = -1  # the most alternatives a drafts row's request asks for (-1: none)
    draft_grammar: tuple | None = None  # (bitmask, rows) over the drafts rows, or None
    # seeded sampled drafts: (index into drafts, the request's generator), rewound after the
    # step to have advanced once per token kept, as plain sampling advances it
    draft_seeded: list = field(default_factory=list)
    draft_model: list[DraftModelRequest] = field(default_factory=list)

    def fill_tokens(self, token_ids: list[int]) -> None:
        """Async scheduling: a batch of one decode row per sequence, prepared before its
        tokens were sampled, takes them (engine/step_chain.py)."""
        ids = self.inputs.input_ids
        if ids.numel() != len(token_ids):
            raise ValueError(f"fill_tokens: {len(token_ids)} tokens for a batch of {ids.numel()} rows")
        ids.copy_(torch.tensor(token_ids, dtype=ids.dtype))


@dataclass
class LaunchedStep:
    """A step queued on the device; its results are readable once the stream has run it."""

    batch: PreparedBatch
    table: torch.Tensor | None  # pinned host memory the sampler's result table is copied into
    prompt_logprobs: list[PromptLogprobs]
    pooled: list  # PooledChunk, read with the prompt logprobs (few requests pool)
    verified: tuple = (None, None)  # verify_on_device's tables, on the device
    seeded_states: list = field(default_factory=list)  # the seeded generators' states before


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, device: torch.device,
                 seed: int, num_blocks: int | None = None):
        """num_blocks: the pool's (default: the caches'; they may hold one more, the hybrid
        layout's null block, kv/groups.py)."""
        self.model = model
        self.kv_caches = kv_caches
        if num_blocks is None:
            num_blocks = kv_caches[0][0].shape[0] if kv_caches else 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.arch.vocab_size
        # for requests without a seed; on the device, so that their noise is drawn there
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # a seeded request's own generator, on the CPU so its tokens do not depend on the device
        self._generators: dict[str, torch.Generator] = {}
        self.graphs = None  # DecodeGraphs, once captured (CUDA, without --enforce-eager)
        self._stream = None  # CUDA: the stream launch() queues steps on, made on first use

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return generator

    @property
    def num_tracked_requests(self) -> int:
        return len(self._generators)

    def kv_resident_bytes(self) -> int | None:
        """The KV pool's memory written so far (its one storage, kv/cache.py); None on a GPU."""
        layer = next((c for c in self.kv_caches if c is not None), None)
        return 0 if layer is None else resident_bytes(layer.key)

    def prepare(self, step: SchedulerOutput) -> PreparedBatch:
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        bs = self.block_size
        input_ids, positions, slots, starts, seq_lens, sample_rows = [], [], [], [0], [], []
        prompt_lp, sampling, generators, pooling = [], [], [], []
        verify_rows, drafts, draft_sampled, draft_inputs, draft_generators = [], [], [], [], []
        draft_seeded, draft_model = [], []
        seqs = step.sequences
        width = max(len(s.block_ids) for s in seqs)
        table_rows = []  # padded, made one tensor at the end (not one small tensor a row)
        for s in seqs:
            first, last = s.start, s.start + len(s.token_ids)
            input_ids.extend(s.token_ids)
            positions.extend(range(first, last))
            blocks = s.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(first, last))
            if s.prompt_logprobs is not None:
                lp = s.prompt_logprobs
                prompt_lp.append(PromptLogprobsRequest(
                    s.request_id, [starts[-1] + i for i in range(len(lp.targets))], lp.targets,
                    lp.k, lp.first_position))
            if s.draft_token_ids:
                end = starts[-1] + len(s.token_ids)
                verify_row = len(verify_rows)
                verify_rows.extend(range(end - len(s.draft_token_ids) - 1, end))
                drafts.append(s.draft_token_ids)
                if s.draft_context is not None:
                    draft_model.append(DraftModelRequest(
                        s.request_id, s.draft_context, s.draft_context_start, s.block_ids,
                        len(drafts) - 1, end - len(s.draft_token_ids), verify_row, s.draft_grammar))
                if s.draft_sampling is not None:  # its rows are rejection-sampled
                    draft_sampled.append(len(drafts) - 1)
                    rows = len(s.draft_token_ids) + 1
                    draft_inputs.extend([s.draft_sampling] * rows)
                    generator = self._generator(s.request_id, s.draft_sampling.params.seed)
                    draft_generators.extend([generator] * rows)
                    if generator is not None:
                        draft_seeded.append((len(drafts) - 1, generator))
            if s.pooling is not None:
                pooling.append(PoolingRows(s.request_id, starts[-1],
                                           starts[-1] + len(s.token_ids), s.pooling))
            starts.append(starts[-1] + len(s.token_ids))
            seq_lens.append(last)
            table_rows.append(list(blocks) + [0] * (width - len(blocks)))
            if s.sampling is not None:
                sample_rows.append(starts[-1] - 1)
                sampling.append(s.sampling)
                generators.append(self._generator(s.request_id, s.sampling.params.seed))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(table_rows, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        )
        if seqs and seqs[0].state_slot >= 0:  # linear-attention layers: every sequence has a row
            _with_state_rows(meta, seqs)
        if seqs and seqs[0].group_block_ids:
            meta = _with_group_tables(meta, seqs, bs)
        logits_rows = sample_rows + [row for p in prompt_lp for row in p.rows] + verify_rows
        inputs = ForwardInputs(torch.tensor(input_ids, dtype=torch.int64),
                               torch.tensor(positions, dtype=torch.int64), meta,
                               torch.tensor(logits_rows, dtype=torch.int64))
        return PreparedBatch(
            inputs, len(sample_rows),
            build_metadata(sampling, generators, self.vocab_size, self.device,
                           grammar=(step.grammar_bitmask, step.constrained_rows)
                           if step.grammar_bitmask is not None else None) if sampling else None,
            prompt_lp, pooling, drafts, draft_sampled,
            build_metadata(draft_inputs, draft_generators, self.vocab_size, self.device)
            if draft_inputs else None,
            max((s.draft_logprobs for s in seqs if s.draft_token_ids and s.draft_logprobs is not None),
                default=-1),
            (step.draft_bitmask, step.draft_constrained_rows) if step.draft_bitmask is not None else None,
            draft_seeded, draft_model)

    def prepare_continuation(self, previous: PreparedBatch, step: SchedulerOutput) -> PreparedBatch:
        """Async scheduling's next step (engine/continuation.py) when it continues every
        sequence of `previous`, a batch of one decode row each: the same batch one position
        further, built from it instead of from scratch (a tenth of prepare's time, which on
        two cores is taken from the forward it overlaps). Else prepare(step)."""
        seqs = step.sequences
        n = len(seqs)
        old = previous.inputs
        if (previous.num_sampled != n or old.input_ids.numel() != n or previous.sampling is None
                or previous.sampling.grammar is not None or previous.prompt_logprobs
                or previous.pooling or previous.drafts or old.meta.group_block_tables is not None
                or any(s.state_source >= 0 or s.state_checkpoint >= 0 for s in seqs)
                or step.finished_request_ids):
            return self.prepare(step)
        bs = self.block_size
        positions = [s.start for s in seqs]
        slots = [s.block_ids[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        tables = old.meta.block_tables
        grown = [row for row, (s, p) in enumerate(zip(seqs, positions)) if p % bs == 0]
        if grown:  # a sequence started a block: its table gained an entry
            width = max(tables.shape[1], max(len(s.block_ids) for s in seqs))
            wider = torch.zeros(n, width, dtype=torch.int32)
            wider[:, : tables.shape[1]] = tables
            for row in grown:
                blocks = seqs[row].block_ids
                wider[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            tables = wider
        # min_tokens bans EOS until a row's output is long enough: the bias changes there
        crossed = any(s.sampling.num_output_tokens == s.sampling.params.min_tokens for s in seqs)
        sampling = previous.sampling
        if crossed:
            sampling = build_metadata([s.sampling for s in seqs], sampling.generators,
                                      self.vocab_size, self.device)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), tables,
                                 old.meta.query_start_loc,
                                 torch.tensor([p + 1 for p in positions], dtype=torch.int32))
        if seqs[0].state_slot >= 0:
            _with_state_rows(meta, seqs)
        inputs = ForwardInputs(torch.empty(n, dtype=torch.int64),
                               torch.tensor(positions, dtype=torch.int64), meta, old.logits_rows)
        return PreparedBatch(inputs, n, sampling)

    @torch.inference_mode()
    def execute_model(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """The forward pass -> float32 logits of inputs.logits_rows (None on ranks other than
        0, or when no row needs logits)."""
        return self._logits(*self._forward(inputs))

    def _forward(self, inputs: ForwardInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden states [T, H] on the device, the logits rows there)."""
        size = self.graphs.bucket(inputs) if self.graphs is not None else None
        if size is not None:
            return self.graphs.run(inputs, size), inputs.logits_rows.to(self.device, non_blocking=True)
        inputs = inputs.to(self.device)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta), inputs.logits_rows

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
        if rows.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[rows])
        return None if logits is None else logits.float()

    @torch.inference_mode()
    def run(self, batch: PreparedBatch) -> ModelRunnerOutput:
        hidden, rows = self._forward(batch.inputs)
        pooled = pool_step(hidden, batch.pooling) if batch.pooling else []
        logits = self._logits(hidden, rows)
        sampled = None
        if batch.sampling is not None:
            sampled = sample(logits[: batch.num_sampled], batch.sampling, self.generator)
        states = [g.get_state() for _, g in batch.draft_seeded]
        verified = self._verified(self._verify_on_device(logits, batch), batch, states)
        return ModelRunnerOutput(sampled, self._prompt_logprobs(logits, batch), pooled, *verified)

    def _verify_on_device(self, logits: torch.Tensor | None, batch: PreparedBatch):
        return verify_on_device(logits, batch.drafts, batch.draft_sampled, batch.draft_sampling,
                                self.generator, batch.draft_logprobs, batch.draft_grammar)

    @staticmethod
    def _verified(tables, batch: PreparedBatch, seeded_states: list):
        table, logprobs = (None if t is None else t.cpu() for t in tables)
        tokens, per_token_logprobs = verify(table, batch.drafts, logprobs, batch.draft_logprobs)
        for (index, generator), state in zip(batch.draft_seeded, seeded_states):
            generator.set_state(state)  # one draw per token kept, as without speculation
            for _ in tokens[index]:
                torch.rand(1, generator=generator, dtype=torch.float64)
        return tokens, per_token_logprobs

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
            hidden, rows = self._forward(batch.inputs)
            pooled = pool_step(hidden, batch.pooling) if batch.pooling else []
            logits = self._logits(hidden, rows)
            table = None
            if batch.sampling is not None:
                on_device = sample_on_device(logits[: batch.num_sampled], batch.sampling, self.generator)
                table = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=True)
                table.copy_(on_device, non_blocking=True)
            prompt_logprobs = self._prompt_logprobs(logits, batch)
            states = [g.get_state() for _, g in batch.draft_seeded]
            verified = self._verify_on_device(logits, batch)
            notify()
        return LaunchedStep(batch, table, prompt_logprobs, pooled, verified, states)

    @staticmethod
    def finish(step: LaunchedStep) -> ModelRunnerOutput:
        """After launch()'s notification: the step's results, read from host memory."""
        sampled = None
        if step.table is not None:
            sampled = read_result_table(step.table, step.batch.sampling.max_num_logprobs)
        return ModelRunnerOutput(sampled, step.prompt_logprobs, step.pooled,
                                 *ModelRunner._verified(step.verified, step.batch, step.seeded_states))


def _with_state_rows(meta: AttentionMetadata, seqs) -> None:
    """The state pool's rows of the step's sequences, the copies around the step (kv/state.py),
    and which start afresh (at position 0), into meta."""
    meta.state_slots = torch.tensor([s.state_slot for s in seqs], dtype=torch.int64)
    meta.state_fresh = torch.tensor([s.start == 0 for s in seqs], dtype=torch.bool)
    meta.state_copy_in = [(s.state_source, s.state_slot) for s in seqs if s.state_source >= 0] or None
    meta.state_copy_out = [(s.state_slot, s.state_checkpoint) for s in seqs if s.state_checkpoint >= 0] or None


def _with_group_tables(meta: AttentionMetadata, seqs, block_size: int) -> AttentionMetadata:
    """The step's metadata with every KV group's tables and slots (the hybrid layout,
    kv/groups.py): the groups' tables stacked, each token's slot read from its group's table."""
    num_groups = 1 + len(seqs[0].group_block_ids)
    tables = torch.zeros(num_groups, *meta.block_tables.shape, dtype=torch.int32)
    tables[0] = meta.block_tables
    for row, s in enumerate(seqs):
        for g, table in enumerate(s.group_block_ids, 1):
            tables[g, row, :len(table)] = torch.tensor(table, dtype=torch.int32)
    starts = meta.query_start_loc
    rows = torch.repeat_interleave(torch.arange(len(seqs)), (starts[1:] - starts[:-1]).long())
    positions = torch.cat([torch.arange(s.start, s.start + len(s.token_ids)) for s in seqs])
    slots = tables[:, rows, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(slots[0], tables[0], meta.query_start_loc, meta.seq_lens, slots, tables,
                             meta.state_slots, meta.state_fresh, meta.state_copy_in, meta.state_copy_out)


@torch.inference_mode()
def _prompt_logprobs(logits: torch.Tensor, req: PromptLogprobsRequest) -> PromptLogprobs:
    targets = torch.tensor(req.targets, device=logits.device)
    picked, ranks, top = logprob_columns(logits, targets, req.k)
    n = len(req.rows)
    return PromptLogprobs(req.request_id, req.first_position, picked[:, 0].tolist(),
                          ranks[:, 0].tolist(), top.indices.tolist() if top else [[]] * n,
                          top.values.tolist() if top else [[]] * n)
