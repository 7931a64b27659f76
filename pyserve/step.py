"""The step boundary: what crosses from the scheduler to the model runner and back, as plain
data. The engine side (scheduler, output processing) and the model side (runner, sampler)
both import this module and nothing of each other.

    Scheduler.schedule() -> SchedulerOutput -> executor -> runner: tensors, forward, sampling
    -> ModelRunnerOutput -> engine: update requests, stop checks, detokenize

The runner never sees a Request: each scheduled sequence carries the tokens to compute, where
they start, the request's block table and, when its last row is sampled, what sampling needs.
A seeded request's generator is the runner's, keyed by request id, created on first use and
dropped when the request's id comes back in finished_request_ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from pyserve.arith import cdiv
from pyserve.sampling_params import SamplingParams


# what a draft position holds until the draft model has proposed its token
DRAFT_PLACEHOLDER = 0


@dataclass
class SamplingInputs:
    """What the sampler needs of one request, for the row that yields its next token."""

    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # banned below min_tokens
    num_output_tokens: int
    # token history for penalties; empty unless params.penalized
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class PromptLogprobsInputs:
    """This step's prompt positions whose next prompt token is scored (prompt_logprobs)."""

    first_position: int  # prompt position of the first scored target
    targets: list[int]  # the prompt tokens scored, one per computed row from the chunk's start
    k: int  # alternatives per position


@dataclass
class PoolingInputs:
    """A pooling (embedding) request's share of a step: which of its hidden-state rows the
    runner reduces, and how (the engine adds the chunks up over a chunked prompt)."""

    pooling_type: str  # "LAST" | "MEAN" | "CLS" | "ALL" (every row: per-token output)
    first_chunk: bool  # the rows start at the prompt's first token
    last_chunk: bool  # the rows end at its last


@dataclass
class ScheduledSequence:
    request_id: str
    token_ids: list[int]  # the tokens computed this step, at positions start, start + 1, ...
    start: int  # num_computed_tokens before the step
    block_ids: list[int]  # the request's whole block table
    sampling: SamplingInputs | None = None  # set when the step's last row yields a token
    prompt_logprobs: PromptLogprobsInputs | None = None
    pooling: PoolingInputs | None = None  # a pooling request: its rows are pooled, never sampled
    # speculative decoding: the proposed tokens, also the tail of token_ids; the runner
    # verifies them greedily over the last len(draft_token_ids) + 1 rows (sampling is None)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_sampling: SamplingInputs | None = None  # a sampled request's (None: greedy)
    draft_logprobs: int | None = None  # the request's logprobs (alternatives per token)
    # a draft model proposes (draft_token_ids are placeholders until it has): the request's
    # tokens from position draft_context_start through its last known token, which the draft
    # model computes before proposing (what its KV cache lacks of them); None: given drafts
    draft_context: list[int] | None = None
    draft_context_start: int = 0
    # a draft model's sequence under a grammar: a fork of the request's matcher, which the
    # proposer walks along the draft's proposals (masking them and the verify rows); it stays
    # on rank 0, the only rank that proposes, and never crosses to the others
    draft_grammar: object | None = None
    # the hybrid KV layout (kv/groups.py): the tables of the KV groups after the first, each
    # as long as block_ids (a sliding group's out-of-window entries name the null block)
    group_block_ids: list[list[int]] = field(default_factory=list)
    # a model with linear-attention layers: the request's slot in the state pool (kv/manager.py);
    # -1 where it has none (other models, and the dummy steps)
    state_slot: int = -1
    # and, under prefix caching, the checkpoint row its state is copied from before the step
    # (a hit that resumes there) and the one it is copied into after it (kv/state.py); -1: none
    state_source: int = -1
    state_checkpoint: int = -1

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence]
    # requests ended since the last step: the runner drops what it holds for them
    finished_request_ids: list[str] = field(default_factory=list)
    # structured outputs: an int32 token bitmask [sampled rows, ceil(vocab / 32)] (bit set =
    # allowed) and the sampled rows (in step order) it constrains; None when none is
    grammar_bitmask: object = None
    constrained_rows: list[int] = field(default_factory=list)
    # the same for the drafts rows (in their order: len(drafts) + 1 rows per sequence with
    # drafts): row i allows what the grammar allows after the sequence's first i drafts
    draft_bitmask: object = None
    draft_constrained_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)


@dataclass
class SampledLogprobs:
    token_logprobs: list[float]  # the chosen token's logprob, per sampled row
    token_ranks: list[int]
    top_ids: list[list[int]]  # per row, the batch's largest requested number of alternatives
    top_logprobs: list[list[float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per sequence with sampling inputs, in the step's order
    logprobs: SampledLogprobs | None


@dataclass
class PromptLogprobs:
    request_id: str
    first_position: int
    target_logprobs: list[float]
    target_ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class PooledChunk:
    """One pooling sequence's rows of this step, reduced: float32 on the CPU, [hidden] for
    LAST (the last chunk's last row), CLS (the first chunk's first row) and MEAN (the rows'
    sum), [rows, hidden] for ALL; None when the chunk holds no row the pooling reads."""

    request_id: str
    data: object  # torch.Tensor | None (this module stays free of torch)


@dataclass
class ModelRunnerOutput:
    sampled: SamplerOutput | None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    pooled: list[PooledChunk] = field(default_factory=list)
    # per sequence with drafts, in step order: its accepted drafts, then the target's own next
    # token (the first mismatch's argmax, or the bonus token after them all)
    verified: list[list[int]] = field(default_factory=list)
    verified_logprobs: list = field(default_factory=list)  # per such sequence: SampledLogprobs | None


def dummy_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """num_tokens of dummy prompts spread over as many sequences as a step may hold, as vLLM's
    profiling run spreads them (each at most max_model_len - 1 tokens, so one more fits)."""
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    per_seq = min(cdiv(num_tokens, num_seqs), max(1, max_model_len - 1))
    full, rest = divmod(num_tokens, per_seq)
    return [per_seq] * full + ([rest] if rest else [])


def dummy_step(lengths: list[int], block_tables: list[list[int]],
               pooled: bool = False, group_tables: list[list[list[int]]] | None = None) -> SchedulerOutput:
    """Prompts of token 0 with the given lengths and block tables (and, under the hybrid KV
    layout, each one's other groups' tables), each sampled greedily once (pooled instead, for
    an encoder, which has no logits): the one dummy batch of the start-up profiling and
    warm-up forwards."""
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    return SchedulerOutput([
        ScheduledSequence(f"dummy-{i}", [0] * n, 0, blocks,
                          None if pooled else SamplingInputs(greedy, (), 0),
                          pooling=PoolingInputs("LAST", True, True) if pooled else None,
                          group_block_ids=group_tables[i] if group_tables else [])
        for i, (n, blocks) in enumerate(zip(lengths, block_tables))])
