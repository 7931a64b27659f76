"""Which requests run this step, and how many tokens each.

The rule, stated once: there are no prefill and decode phases. Each request's
num_computed_tokens catches up with its num_tokens under a per-step token budget
(max_num_batched_tokens). Running requests go first (a decode needs one token, an unfinished
prompt gets the next chunk), then waiting requests are admitted while the budget, max_num_seqs
and free blocks allow. This one mechanism gives continuous batching and chunked prefill.

A waiting request is admitted with whatever leading full blocks the prefix cache already
holds (num_computed_tokens starts past them). One whose next prompt block is being computed
right now by a running request waits a step instead, and then finds it cached: a burst of
requests sharing a long prefix computes it once, not once per request. This wait cannot
serialise a burst (issue 68 asked): the blocks a request waits for are the prompt blocks of a
running request, which gets its next chunk before anyone waiting is admitted, and they stop
counting as they are computed (or when their request is preempted or ends). So a waiter is
held for the step that admits the owner and then only while the owner's chunks (served before
any admission) compute the shared blocks; then every waiter is admitted together, as far as
the budget goes, each past the shared blocks.

When a running request cannot get the blocks its tokens need, the lowest-priority request
(largest (priority, arrival) key) is preempted: its blocks are freed and it waits again with
its output so far, to be recomputed later. Nothing new is admitted in a step that preempted.
Every path out of RUNNING (preemption, finish, abort) returns the request's blocks exactly
once, through the KV manager, which holds them by request id.

The scheduler owns num_computed_tokens: it advances it when a step's results come back
(computed()), and sets it at admission (past the cached prefix) and preemption (to 0). What
it hands the model runner is plain data (pyserve/step.py), never a Request.
"""

from __future__ import annotations

import bisect

from pyserve.config import SchedulerConfig
from pyserve.engine.ngram import (FIRST_LOOKAHEAD, PAUSE_TOKENS, TokenHistory, next_lookahead,
                                  propose)
from pyserve.engine.request import Request, RequestStatus
from pyserve.kv.manager import KVCacheManager
from pyserve.step import (DRAFT_PLACEHOLDER, PoolingInputs, PromptLogprobsInputs, SamplingInputs,
                          ScheduledSequence, SchedulerOutput)


def scheduled_sequence(request: Request, num_new_tokens: int, block_ids: list[int],
                       drafts: list[int] | None = None, draft_model: bool = False) -> ScheduledSequence:
    """A request's share of a step, as plain data. It is sampled when the step computes its
    last known token (so it yields the next one); with drafts, they follow that token and
    the runner verifies them instead."""
    first = request.num_computed_tokens
    last = first + num_new_tokens
    if drafts:
        params = request.params
        return ScheduledSequence(
            request.request_id, request.all_token_ids[first:last] + drafts, first, block_ids,
            draft_token_ids=list(drafts), draft_sampling=None if params.greedy else SamplingInputs(
                params, request.eos_token_ids, len(request.output_token_ids)),
            draft_logprobs=params.logprobs,
            draft_context=request.all_token_ids[request.draft_synced:last] if draft_model else None,
            draft_context_start=request.draft_synced)
    if request.pooling is not None:  # pooled, never sampled
        return ScheduledSequence(request.request_id, request.all_token_ids[first:last], first,
                                 block_ids, pooling=PoolingInputs(
                                     request.pooling.pooling_type, first == 0,
                                     last == request.num_tokens))
    params = request.params
    sampling = None
    if last == request.num_tokens:
        history = params.penalized
        sampling = SamplingInputs(params, request.eos_token_ids, len(request.output_token_ids),
                                  request.prompt_token_ids if history else [],
                                  request.output_token_ids if history else [])
    prompt_logprobs = None
    if params.prompt_logprobs is not None:
        prompt = request.prompt_token_ids
        scored = range(first, min(last, len(prompt) - 1))
        if scored:
            prompt_logprobs = PromptLogprobsInputs(first + 1, prompt[first + 1: scored.stop + 1],
                                                   params.prompt_logprobs)
    return ScheduledSequence(request.request_id, request.all_token_ids[first:last], first,
                             block_ids, sampling, prompt_logprobs)


def _verifiable(request: Request) -> bool:
    """Its next tokens depend on the logits alone, which verification reads (greedily, or by
    rejection sampling, under the grammar's masks if it has one): no penalties (their
    history moves along the drafts), logit bias, EOS ban (min_tokens) or reasoning that may
    end inside the drafts (the grammar would start there) or a thinking budget (a draft could
    run past it) in the way."""
    p = request.params
    return (not p.penalized and not p.logit_bias
            and (request.matcher is None or request.grammar_after is None)
            and request.thinking is None
            and request.pooling is None
            and len(request.output_token_ids) >= p.min_tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int = 1 << 30):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished_ids: list[str] = []  # ended since the last step, for the runner
        self._drafts: dict[str, list[int]] = {}  # this step's proposals, by request id

    def _key(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival)

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_finished_pending(self) -> int:
        """Requests ended since the last step with sequences: the runner hears of them then."""
        return len(self._finished_ids)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences. A step with none still hands over the finished ids only when
        a later step has sequences (the runner holds nothing that matters in between)."""
        self._drafts: dict[str, list[int]] = {}
        scheduled = self._schedule()
        spec = self.config.speculative_config
        draft_model = spec is not None and spec.method == "draft_model"
        sequences = [scheduled_sequence(r, n, self.kv.block_ids(r.request_id),
                                        self._drafts.get(r.request_id), draft_model)
                     for r, n in scheduled]
        if self.kv.num_groups > 1:  # the hybrid layout: each KV group's table (kv/groups.py)
            for seq in sequences:
                seq.group_block_ids = self.kv.group_block_ids(seq.request_id)
        if self.kv.state is not None:  # linear-attention layers: each request's state rows
            for (request, _), seq in zip(scheduled, sequences):
                seq.state_slot, seq.state_source, seq.state_checkpoint = self.kv.state_rows(
                    request.request_id, seq.start, len(seq.token_ids), request.all_token_ids)
        finished = []
        if sequences:
            finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(sequences, finished)

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self.kv.cut_step(request.num_computed_tokens,
                                 min(request.num_tokens - request.num_computed_tokens, budget),
                                 request.num_tokens)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n,
                                             request.num_computed_tokens):
                victim = max(self.running, key=self._key)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                # Under the priority policy the victim may already be scheduled this step.
                for entry in scheduled:
                    if entry[0] is victim:
                        scheduled.remove(entry)
                        budget += entry[1]
                        break
            else:
                scheduled.append((request, n))
                budget -= n
            i = self._index_after(request)

        i = 0
        while (not preempted and i < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[i]
            pooling = request.pooling
            if pooling is not None and pooling.whole_prompt and request.num_tokens > budget:
                i += 1  # attends in both directions: the whole prompt in one step, a later one
                continue
            # prompt logprobs and most poolings read every position: computed, not cached
            use_cache = request.params.prompt_logprobs is None and (pooling is None or pooling.cacheable)
            if self.kv.prefix_in_flight(request.request_id, request.all_token_ids, use_cache):
                i += 1  # let the request that computes the shared prefix finish it
                continue
            admitted = self.kv.allocate_new(request.request_id, request.all_token_ids, budget,
                                            use_cache, count_lookup=request.num_preemptions == 0)
            if admitted is None:
                break
            cached, n = admitted
            request.num_computed_tokens = cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = cached  # vLLM reports the first admission's hits
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, n))
            budget -= n
        if not preempted:  # drafts last: from what the required tokens left over
            for request, n in scheduled:
                drafts = self._speculate(request, n, budget)
                if drafts:
                    self._drafts[request.request_id] = drafts
                    budget -= len(drafts)
        return scheduled

    def _speculate(self, request: Request, n: int, budget: int) -> list[int]:
        """Prompt-lookup drafts for a decoding request (one new token), within what the
        step's budget and free blocks leave once every scheduled request has its required
        tokens (drafts never preempt anyone), its max_tokens and the model length, with their
        KV slots allocated; [] otherwise. A rejected draft's slot is simply overwritten
        later: only accepted tokens advance num_computed_tokens."""
        spec = self.config.speculative_config
        if (spec is None or n != 1 or request.num_computed_tokens + 1 != request.num_tokens
                or not _verifiable(request)):
            return []  # only a step that computes the last known token can carry drafts
        if spec.disable_by_batch_size is not None and len(self.running) > spec.disable_by_batch_size:
            return []  # a batch this large is compute-bound: extra rows cost what they save
        cap = request.params.max_drafts
        if cap == 0:
            return []  # the request opted out
        if request.lookahead is None:
            request.lookahead = min(spec.num_speculative_tokens, FIRST_LOOKAHEAD)
        k = request.lookahead
        if k == 0:
            if len(request.output_token_ids) < request.lookahead_resume:
                return []
            k = request.lookahead = 1
        if cap is not None:
            k = min(k, cap)
        room = min(k, budget,
                   request.max_tokens - len(request.output_token_ids) - 1,
                   self.max_model_len - request.num_tokens - 1)
        if room <= 0:
            return []
        if spec.method == "draft_model":
            # the draft model fills them in on the model thread (under the request's grammar,
            # if any: EngineCore._draft_masks hands it a fork of the matcher)
            drafts = [DRAFT_PLACEHOLDER] * room
        else:
            if request.token_history is None:
                request.token_history = TokenHistory()
            drafts = propose(request.token_history.sync(request.all_token_ids), room,
                             spec.prompt_lookup_min, spec.prompt_lookup_max, by_match_length=True)
        if not drafts or not self.kv.allocate_slots(request.request_id,
                                                    request.num_computed_tokens + 1 + len(drafts),
                                                    request.num_computed_tokens):
            return []
        return drafts

    def verified(self, request: Request, drafted: int, kept: int) -> None:
        """A speculated step's outcome: the request's next lookahead (engine/ngram.py)."""
        spec = self.config.speculative_config
        k = spec.num_speculative_tokens if request.lookahead is None else request.lookahead
        request.lookahead = next_lookahead(k, drafted, kept, spec.num_speculative_tokens)
        # the draft model's KV is right through the last token before the step and the kept
        # drafts it computed (all but the last draft, which it proposed without computing)
        request.draft_synced = request.num_computed_tokens - (1 if kept == drafted else 0)
        if kept:
            request.lookahead_pauses = 0
        if request.lookahead == 0:  # each pause in a row twice as long as the last
            request.lookahead_resume = (len(request.output_token_ids)
                                        + PAUSE_TOKENS * 2 ** request.lookahead_pauses)
            request.lookahead_pauses += 1

    def _index_after(self, request: Request) -> int:
        try:
            return self.running.index(request) + 1
        except ValueError:  # it was preempted
            return len(self.running)

    def computed(self, request: Request, num_new_tokens: int) -> None:
        """A step computed num_new_tokens more of the request's tokens: their K/V are cached,
        and its blocks that became full are registered for prefix reuse."""
        request.num_computed_tokens += num_new_tokens
        self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                  request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.draft_synced = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def finish(self, request: Request) -> None:
        """Takes a finished or aborted request out of the queues; its blocks and everything
        the KV manager and the runner hold for it go."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.forget(request.request_id)
        self._finished_ids.append(request.request_id)
