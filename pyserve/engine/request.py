"""One request's life: WAITING -> RUNNING <-> PREEMPTED(waiting again) -> FINISHED.

num_computed_tokens counts the tokens whose K/V are in the cache. Each step the scheduler lets
it catch up with num_tokens (prompt + output so far); when it has caught up, the step's last
logits sample the next token. There are no separate prefill and decode phases."""

from __future__ import annotations

import enum
import time

from pyserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, prompt: str | None = None,
                 arrival: int = 0, priority: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.max_tokens = max_tokens  # resolved against the model length
        self.arrival = arrival
        self.priority = priority  # lower runs first under --scheduling-policy priority
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, kept whole (no concatenation a step)
        self.num_computed_tokens = 0  # the scheduler's: tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at admission
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = None  # IncrementalDetokenizer, set by the engine core
        self.group_id = request_id  # the client's request id (n > 1: shared by the children)
        self.child_index = 0
        self.logprobs: list | None = [] if params.logprobs is not None else None
        # the sum of the chosen tokens' logprobs, kept when logprobs are asked for (vLLM's)
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_sent_tokens = 0  # output tokens already handed out (streaming)
        self.num_preemptions = 0
        # structured outputs: this completion's xgrammar GrammarMatcher, advanced by each
        # accepted token (a recomputed request keeps it: its tokens are kept too)
        self.matcher = None
        # with a reasoning model, the grammar starts after this token (the end of thinking)
        self.grammar_after: int | None = None
        # thinking_token_budget's ThinkingBudget (engine/thinking_budget.py), or None
        self.thinking = None
        # speculative decoding: drafts to propose next (None: the configured number), and the
        # output length at which a paused request (lookahead 0) tries again
        self.lookahead: int | None = None
        self.lookahead_resume = 0
        self.lookahead_pauses = 0  # pauses since drafts were last kept
        self.token_history = None  # n-gram lookup's array of all_token_ids (engine/ngram.py)
        # a draft model's KV cache holds this request's first draft_synced positions
        self.draft_synced = 0
        # a pooling (embedding) request: its PoolingState (engine/pooling.py); it never samples
        self.pooling = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
