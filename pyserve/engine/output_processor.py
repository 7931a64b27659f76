"""What a step's sampled tokens do to their requests: logprobs assembled (each token's text
decoded once, from a memo of single-token texts: a token decodes alone the same wherever it
stands), the token appended with the stop checks and incremental text (engine/stop.py), the
engine's figures, and the outputs each request is owed."""

from __future__ import annotations

import logging

from pyserve.engine.output import Logprob, PositionLogprobs, RequestOutput
from pyserve.engine.request import Request
from pyserve.engine.request_group import RequestGroup
from pyserve.engine.request_table import RequestTable
from pyserve.engine.stats import EngineStats
from pyserve.engine.stop import append_token
from pyserve.step import PromptLogprobs, SampledLogprobs

logger = logging.getLogger("pyserve")


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, stats: EngineStats):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.stats = stats
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprob(self, token_id: int, value: float, rank: int) -> Logprob:
        return Logprob(value, rank, self.token_text(token_id))

    def position_logprobs(self, sampled: SampledLogprobs, row: int, token: int, k: int) -> PositionLogprobs:
        """The chosen token first, then the top-k alternatives, each with its rank."""
        entry = {token: self._logprob(token, sampled.token_logprobs[row], sampled.token_ranks[row])}
        for rank, (alt, value) in enumerate(zip(sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]), 1):
            if alt not in entry:
                entry[alt] = self._logprob(alt, value, rank)
        return entry

    def record_prompt_logprobs(self, results: list[PromptLogprobs], table: RequestTable) -> None:
        for r in results:
            request = table.child(r.request_id)
            if request is None:  # aborted while the step ran
                continue
            group = table.group_of(request)
            if group.prompt_logprobs is None:
                continue
            prompt = request.prompt_token_ids
            for i, value in enumerate(r.target_logprobs):
                position = r.first_position + i
                if position != len(group.prompt_logprobs):  # recomputed (a preemption, a sibling)
                    continue
                token = prompt[position]
                entry = {token: self._logprob(token, value, r.target_ranks[i])}
                for rank, (alt, alt_value) in enumerate(zip(r.top_ids[i], r.top_logprobs[i]), 1):
                    if alt not in entry:
                        entry[alt] = self._logprob(alt, alt_value, rank)
                group.prompt_logprobs.append(entry)

    def add_token(self, request: Request, token: int, sampled: SampledLogprobs | None, row: int,
                  now: float) -> None:
        """The request's next token, with its logprobs if asked; may finish the request."""
        if request.logprobs is not None:
            entry = self.position_logprobs(sampled, row, token, request.params.logprobs)
            request.logprobs.append(entry)
            request.cumulative_logprob += entry[token].logprob
        append_token(request, token, self.max_model_len)
        if request.thinking is not None:
            request.thinking.accept(token)
        matcher = request.matcher
        if request.grammar_after is not None:  # still reasoning: the grammar waits
            if token == request.grammar_after:
                request.grammar_after = None
        elif matcher is not None and not matcher.is_terminated():
            if not matcher.accept_token(token):  # the mask allowed only what it accepts
                logger.warning("request %s: token %d is outside its grammar", request.request_id, token)
            elif matcher.is_terminated() and not request.finished:
                request.finish("stop")  # the grammar is complete (ignore_eos: no EOS ended it)
        self.stats.on_token(request, now)
        if request.finished:
            self.stats.on_finished(request, now)

    @staticmethod
    def output(group: RequestGroup, request: Request) -> RequestOutput | None:
        return group.output(request)
