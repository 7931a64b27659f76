"""Admission: whether a request can ever run here (InvalidRequest naming the field if not), and
its fan-out into one Request per completion (n of them), grouped."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pyserve.engine.request import Request
from pyserve.engine.request_group import RequestGroup
from pyserve.engine.thinking_budget import ThinkingBudget, last_index
from pyserve.errors import InvalidRequest
from pyserve.kv.groups import KVGroups, sequence_blocks
from pyserve.sampling_params import RequestOutputKind, SamplingParams
from pyserve.tokenizer.detokenizer import IncrementalDetokenizer

# prompt_logprobs entries (positions x (k + 1)) one request may ask for: prompt_logprobs -1 over
# a 49k-token vocabulary is 49k Python objects a position, so this bounds a response near 150 MB
MAX_PROMPT_LOGPROB_ENTRIES = 2**20
# the same bound on sampled tokens' logprobs (n x max_tokens x (k + 1)), for k above vLLM's
# default --max-logprobs: top_logprobs -1 is a response of vocabulary-sized lists
MAX_LOGPROB_ENTRIES = 2**20
UNGUARDED_LOGPROBS = 20


@dataclass(frozen=True)
class Limits:
    """What admission checks a request against."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_logprobs: int  # -1: the vocabulary
    priority_scheduling: bool
    kv_groups: KVGroups | None = None  # the hybrid KV layout (kv/groups.py)
    chunk: int = 0  # --max-num-batched-tokens: what a sliding group holds beyond its window

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens holds at most."""
        return sequence_blocks(self.kv_groups, num_tokens, self.block_size, self.chunk)


def _admissible_max_tokens(prompt_token_ids: list[int], params: SamplingParams, limits: Limits) -> int:
    """Raises InvalidRequest naming what makes the request impossible; returns its max_tokens."""
    n = len(prompt_token_ids)
    vocab, max_len = limits.vocab_size, limits.max_model_len
    if n == 0:
        raise InvalidRequest("prompt", "The decoder prompt cannot be empty")  # vLLM's words
    if params.max_tokens is not None and params.max_tokens > max_len:
        # vLLM's first length check (its TokenizeParams), before the prompt is weighed: Claude
        # Code's max_tokens 32000 against a smaller --max-model-len meets this one
        raise InvalidRequest("max_tokens", f"max_tokens={params.max_tokens} cannot be greater than "
                             f"max_model_len={max_len}. Please request fewer output tokens.")
    # the length before the ids (vLLM reads the ids first): a prompt of megabytes is refused
    # without a walk over it on the event loop, so what is walked is at most max_model_len
    if n >= max_len:
        raise InvalidRequest("max_tokens", f"This model's maximum context length is {max_len} "
                             f"tokens. However, your prompt has {n} tokens. Please shorten the prompt.")
    # min and max are C loops, the Python walk only finds the bad id to name
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
        # vLLM's wording, which clients match on
        raise InvalidRequest("prompt", f"Token id {bad} is out of vocabulary (token ids must "
                             f"lie in [0, {vocab}))")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
    if n + max_tokens > max_len:
        raise InvalidRequest("max_tokens", f"This model's maximum context length is {max_len} "
                             f"tokens. However, you requested {n + max_tokens} tokens ({n} in the "
                             f"messages, {max_tokens} in the completion). Please reduce the length "
                             "of the messages or completion (max_tokens).")
    if limits.blocks_for(n + max_tokens) > limits.num_blocks:
        raise InvalidRequest(None, f"{n + max_tokens} tokens cannot fit in the whole KV cache "
                             f"({limits.num_blocks * limits.block_size} tokens)")
    invalid = [t for t in params.logit_bias or () if not 0 <= t < vocab]
    if invalid:
        raise InvalidRequest("logit_bias", f"token_id(s) {invalid} in logit_bias contain "
                             f"out-of-vocab token ids. Vocabulary size: {vocab}")
    _check_logprobs(n, max_tokens, params, limits)
    return max_tokens


def check_admissible(prompt_token_ids: list[int], params: SamplingParams, limits: Limits) -> int:
    """Admission's checks without admitting (beam search checks its whole search up front):
    InvalidRequest naming what makes the request impossible, else its max_tokens."""
    return _admissible_max_tokens(prompt_token_ids, params, limits)


def _check_logprobs(n: int, max_tokens: int, params: SamplingParams, limits: Limits) -> None:
    """vLLM's rule: -1 is the whole vocabulary, and neither count may pass --max-logprobs
    (-1: the vocabulary). Beyond that, the memory guards on what one response may hold."""
    vocab = limits.vocab_size
    limit = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        value = vocab if value == -1 else value
        if value is not None and value > limit:
            kind = "sample" if name == "logprobs" else "prompt"
            raise InvalidRequest(name, f"Requested {kind} logprobs of {value}, which is greater "
                                 f"than max allowed: {limit} (--max-logprobs; -1 allows the "
                                 "whole vocabulary)")
    if params.logprobs is not None:
        k = vocab if params.logprobs == -1 else params.logprobs
        entries = params.n * max_tokens * (k + 1)
        # within vLLM's default --max-logprobs (20) a request is never held to the guard
        if k > UNGUARDED_LOGPROBS and entries > MAX_LOGPROB_ENTRIES:
            raise InvalidRequest("logprobs", f"logprobs of {k} for up to {max_tokens} tokens "
                                 f"(n={params.n}) could return {entries} entries, more than "
                                 f"the {MAX_LOGPROB_ENTRIES} one response may hold; lower "
                                 "max_tokens or ask for fewer logprobs")
    if params.prompt_logprobs is not None:
        k = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
        if (n - 1) * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise InvalidRequest("prompt_logprobs", f"prompt_logprobs of {k} for {n} prompt tokens "
                                 f"would return {(n - 1) * (k + 1)} entries, more than the "
                                 f"{MAX_PROMPT_LOGPROB_ENTRIES} one response may hold; ask for "
                                 "fewer or score a shorter prompt")


class Admission:
    def __init__(self, limits: Limits, eos_token_ids: tuple[int, ...], tokenizer,
                 staged_siblings: bool, grammars=None,
                 reasoning_markers: tuple[int, int] | None = None):
        """staged_siblings: n > 1 completions wait for the first to compute the prompt (with
        prefix caching, so that they find its blocks cached); grammars: the GrammarCompiler
        for structured outputs (each completion gets its own matcher); reasoning_markers: a
        reasoning model's (start, end) token ids: a grammar applies only after the end, unless
        the prompt has already closed the reasoning (enable_thinking false)."""
        self.limits = limits
        self.grammars = grammars
        self.reasoning_markers = reasoning_markers
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.staged = staged_siblings
        self._arrivals = itertools.count()

    def next_arrival(self) -> int:
        """The arrival number of the next request (its FCFS place)."""
        return next(self._arrivals)

    def _reasoning_end(self, prompt_token_ids: list[int]) -> int | None:
        """The token that ends the reasoning a grammar waits for; None if it need not wait."""
        if self.reasoning_markers is None:
            return None
        start, end = self.reasoning_markers
        closed = last_index(prompt_token_ids, end) > last_index(prompt_token_ids, start)
        return None if closed else end

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              prompt: str | None = None, priority: int = 0) -> RequestGroup:
        """The request's group of n completions, or InvalidRequest saying why it can never run."""
        max_tokens = _admissible_max_tokens(prompt_token_ids, params, self.limits)
        vocab = self.limits.vocab_size
        if params.logprobs == -1 or params.prompt_logprobs == -1:  # -1: the whole vocabulary
            params = dataclasses.replace(
                params, logprobs=vocab if params.logprobs == -1 else params.logprobs,
                prompt_logprobs=vocab if params.prompt_logprobs == -1 else params.prompt_logprobs)
        if priority != 0 and not self.limits.priority_scheduling:
            raise InvalidRequest("priority", f"priority {priority} was given, but priority "
                                 "scheduling is not enabled (--scheduling-policy priority)")
        if params.thinking_token_budget is not None and self.reasoning_markers is None:
            raise InvalidRequest("thinking_token_budget", "thinking_token_budget needs "
                                 "--reasoning-parser, on a model whose tokenizer has its <think> "
                                 "and </think> as one token each")
        compiled = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequest("structured_outputs", "this engine has no grammar backend")
            compiled = self.grammars.compile(params.structured_outputs)  # GrammarError: a 400
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
            if compiled is not None:
                child.matcher = self.grammars.matcher(compiled)
                child.grammar_after = self._reasoning_end(prompt_token_ids)
            if params.thinking_token_budget is not None:
                child.thinking = ThinkingBudget(params.thinking_token_budget,
                                                *self.reasoning_markers, prompt_token_ids)
            children.append(child)
        return RequestGroup(request_id, children, staged=self.staged)


def admit_pooling(limits: Limits, request_id: str, prompt_token_ids: list[int], state,
                  arrival: int, prompt: str | None = None, priority: int = 0) -> RequestGroup:
    """A pooling request's group (one Request that never samples, holding `state`), or
    InvalidRequest. Its whole prompt may fill the model's length: nothing is generated."""
    n, vocab, max_len = len(prompt_token_ids), limits.vocab_size, limits.max_model_len
    if n == 0:
        raise InvalidRequest("input", "input is empty")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:  # C loops, not Python's
        raise InvalidRequest("input", f"input holds token ids outside the vocabulary [0, {vocab})")
    if n > max_len:
        raise InvalidRequest("input", f"This model's maximum context length is {max_len} tokens. "
                             f"However, you requested {n} tokens in the input for embedding "
                             "generation. Please reduce the length of the input.")
    if limits.blocks_for(n) > limits.num_blocks:
        raise InvalidRequest("input", f"{n} tokens cannot fit in the whole KV cache "
                             f"({limits.num_blocks * limits.block_size} tokens)")
    if priority != 0 and not limits.priority_scheduling:
        raise InvalidRequest("priority", f"priority {priority} was given, but priority "
                             "scheduling is not enabled (--scheduling-policy priority)")
    params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
    request = Request(request_id, prompt_token_ids, params, (), 0, prompt=prompt, arrival=arrival,
                      priority=priority)
    request.pooling = state
    return RequestGroup(request_id, [request], staged=False)
