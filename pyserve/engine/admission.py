"""Admission: whether a request can ever run here (InvalidRequest naming the field if not), and
its fan-out into one Request per completion (n of them), grouped."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from pyserve.arith import cdiv
from pyserve.engine.request import Request
from pyserve.engine.request_group import RequestGroup
from pyserve.errors import InvalidRequest
from pyserve.sampling_params import SamplingParams
from pyserve.tokenizer.detokenizer import IncrementalDetokenizer

# prompt_logprobs entries (positions x (k + 1)) one request may ask for: prompt_logprobs -1 over
# a 49k-token vocabulary is 49k Python objects a position, so this bounds a response near 150 MB
MAX_PROMPT_LOGPROB_ENTRIES = 2**20


@dataclass(frozen=True)
class Limits:
    """What admission checks a request against."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_logprobs: int  # -1: the vocabulary
    priority_scheduling: bool


def _admissible_max_tokens(prompt_token_ids: list[int], params: SamplingParams, limits: Limits) -> int:
    """Raises InvalidRequest naming what makes the request impossible; returns its max_tokens."""
    n = len(prompt_token_ids)
    vocab, max_len = limits.vocab_size, limits.max_model_len
    if n == 0:
        raise InvalidRequest("prompt", "prompt is empty")
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise InvalidRequest("prompt", f"prompt holds token ids outside the vocabulary [0, {vocab})")
    if n >= max_len:
        raise InvalidRequest("max_tokens", f"This model's maximum context length is {max_len} "
                             f"tokens. However, your prompt has {n} tokens. Please shorten the prompt.")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_len - n
    if n + max_tokens > max_len:
        raise InvalidRequest("max_tokens", f"This model's maximum context length is {max_len} "
                             f"tokens. However, you requested {n + max_tokens} tokens ({n} in the "
                             f"messages, {max_tokens} in the completion). Please reduce the length "
                             "of the messages or completion (max_tokens).")
    if cdiv(n + max_tokens, limits.block_size) > limits.num_blocks:
        raise InvalidRequest(None, f"{n + max_tokens} tokens cannot fit in the whole KV cache "
                             f"({limits.num_blocks * limits.block_size} tokens)")
    if any(not 0 <= t < vocab for t in params.logit_bias or ()):
        raise InvalidRequest("logit_bias", "logit_bias contains out-of-vocab token ids. "
                             f"Vocabulary size: {vocab}")
    limit = vocab if limits.max_logprobs == -1 else limits.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        value = vocab if value == -1 else value
        if value is not None and value > limit:
            raise InvalidRequest(name, f"{name} must be at most {limit} (--max-logprobs), got {value}")
    if params.prompt_logprobs is not None:
        k = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
        if (n - 1) * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise InvalidRequest("prompt_logprobs", f"prompt_logprobs of {k} for {n} prompt tokens "
                                 f"would return {(n - 1) * (k + 1)} entries, more than the "
                                 f"{MAX_PROMPT_LOGPROB_ENTRIES} one response may hold; ask for "
                                 "fewer or score a shorter prompt")
    return max_tokens


def _last(ids: list[int], token: int) -> int:
    return max((i for i, t in enumerate(ids) if t == token), default=-1)


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

    def _reasoning_end(self, prompt_token_ids: list[int]) -> int | None:
        """The token that ends the reasoning a grammar waits for; None if it need not wait."""
        if self.reasoning_markers is None:
            return None
        start, end = self.reasoning_markers
        closed = _last(prompt_token_ids, end) > _last(prompt_token_ids, start)
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
            children.append(child)
        return RequestGroup(request_id, children, staged=self.staged)
