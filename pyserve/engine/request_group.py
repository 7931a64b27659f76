"""A client's request as the engine sees it: one Request per completion (n of them), and the
outputs it is owed.

With n > 1 the completions share the prompt's KV blocks through the prefix cache: the first
completion is scheduled alone, and its siblings are released once it has computed the prompt,
so their admission finds the prompt's full blocks cached. Without prefix caching all n start
at once."""

from __future__ import annotations

import dataclasses

from pyserve.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from pyserve.engine.request import Request
from pyserve.sampling_params import RequestOutputKind


class RequestGroup:
    def __init__(self, request_id: str, children: list[Request], staged: bool):
        self.request_id = request_id
        self.children = children
        self.pending = children[1:] if staged else []  # siblings not yet scheduled
        self.kind = children[0].params.output_kind
        self.prompt_logprobs: list | None = (
            [None] if children[0].params.prompt_logprobs is not None else None)

    @staticmethod
    def child_params(params, index: int):
        if params.n == 1:
            return params
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)

    def release_pending(self) -> list[Request]:
        """Siblings whose turn has come (the first child has computed the prompt, or ended)."""
        first = self.children[0]
        if self.pending and (first.finished or
                             first.num_computed_tokens >= len(first.prompt_token_ids)):
            released, self.pending = self.pending, []
            return released
        return []

    def output(self, child: Request) -> RequestOutput | None:
        """What is owed after `child` advanced (None: nothing to send yet)."""
        finished = self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [_completion(c, cumulative=True) for c in self.children]
        elif self.kind is RequestOutputKind.DELTA:
            completions = [_completion(child, cumulative=False)]
        else:
            completions = [_completion(c, cumulative=True) for c in self.children
                           if c.output_token_ids or c is child]
        first = self.children[0]
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and self.kind is RequestOutputKind.DELTA:
            prompt_logprobs = prompt_logprobs if not first.prompt_logprobs_sent else None
            first.prompt_logprobs_sent = True
        return RequestOutput(self.request_id, first.prompt, first.prompt_token_ids, completions,
                             finished=finished, prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=first.num_cached_tokens,
                             metrics=self._metrics())

    def _metrics(self) -> RequestMetrics:
        first = self.children[0]
        firsts = [c.first_token_time for c in self.children if c.first_token_time is not None]
        lasts = [c.last_token_time for c in self.children if c.last_token_time is not None]
        return RequestMetrics(first.arrival_time, first.first_scheduled_time,
                              min(firsts, default=None), max(lasts, default=None))


def _completion(request: Request, cumulative: bool) -> CompletionOutput:
    delta = request.detokenizer.new_text(request.finished)
    if cumulative:
        text, ids = request.detokenizer.emitted_text, list(request.output_token_ids)
        logprobs = request.logprobs
    else:
        start = request.num_sent_tokens
        text, ids = delta, request.output_token_ids[start:]
        logprobs = request.logprobs[start:] if request.logprobs is not None else None
    request.num_sent_tokens = len(request.output_token_ids)
    return CompletionOutput(request.child_index, text, ids, request.finish_reason,
                            request.stop_reason, logprobs, request.cumulative_logprob)

