"""Async scheduling's plan of the next step: built on the event loop while a step runs, before
its tokens are known (vLLM's --async-scheduling; engine/step_chain.py runs it).

A continuation gives each sequence of the running step one more decode row: the token that
step samples for it (a placeholder until then) at the next position, in a KV slot allocated
now, with sampling inputs one output token further on. It is built only where that is exactly
the step the scheduler would schedule next for those sequences:

  - every sequence of the running step samples its next token (a decode, or a prompt's last
    chunk) and has no drafts, prompt logprobs or pooling;
  - none is under a grammar or a thinking budget, or penalized (their next inputs depend on
    the token being sampled);
  - nothing waits to be admitted (a waiting request's prefill would join the next step), and
    every running request is in the running step (the next one would take them all);
  - the step is small (MAX_CONTINUED_SEQUENCES), where the gap it hides matters;
  - every sequence's next slot fits in its blocks or in the free pool.

So under a queue (requests waiting, even ones that cannot be admitted yet) steps are scheduled
as usual; the chain runs over stretches of decoding.

A sequence whose token ends its request (max_tokens, the model length) gets no row. One that
ends for another reason (a stop, an abort) while the continuation runs has its row computed
and dropped by update(), which skips finished requests. That row's K/V land in a block freed
meanwhile, which the next plan may give to another request S. This is safe:
  - the model thread runs steps one after another, so S's first write to the block (in the
    step after) comes after the stray one;
  - a sequence writes each slot before it reads it, and a block handed out by allocate_slots
    is never a prefix-cache hit (only admission looks those up); the stray row's block itself
    holds no cache entry, its last position never having been computed.

Greedy and seeded requests get exactly the tokens plain scheduling gives them. An unseeded
sampled request draws from the runner's shared generator, which a dropped row also draws
from: under a fixed --seed its tokens may differ (they are as random)."""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.engine.request import RequestStatus
from pyserve.step import DRAFT_PLACEHOLDER, SamplingInputs, ScheduledSequence, SchedulerOutput


# Larger steps are scheduled as usual. The gap a continuation hides (the loop's wake-up,
# update, scheduling and hand-over: about 0.5 ms on two cores) is a tenth of a one-sequence
# decode step but 1 % of a 16-sequence one, while the loop's work moved into the step competes
# with the model's threads for the cores. Measured on two cores (W1's and W2's shapes, the two
# modes taking turns; docs/performance.md): 1 sequence 3 % faster; 4 about even; 16 no better
# (one pair of two 5 % slower), where at most 1 % could be won.
MAX_CONTINUED_SEQUENCES = 4


@dataclass
class Continuation:
    step: SchedulerOutput  # one decode row per continued sequence, its token a placeholder
    # continued row i takes the token the running step sampled in its row rows[i]
    rows: list[int]


def _continued(request, seq: ScheduledSequence, requests) -> bool:
    """The running step's sequence yields the token its (running) request computes next, and
    nothing about that computation depends on the token."""
    if (seq.sampling is None or seq.draft_token_ids or seq.prompt_logprobs is not None
            or seq.pooling is not None):
        return False
    return (request.matcher is None and request.thinking is None and request.pooling is None
            and not request.params.penalized
            # n > 1: siblings staged behind the first completion join when it has sampled
            and not requests.group_of(request).pending
            # the scheduler's view is the step's: its tokens are the request's last known ones
            and request.num_computed_tokens == seq.start
            and request.num_tokens == seq.start + len(seq.token_ids))


def plan_continuation(step: SchedulerOutput, requests, scheduler, max_model_len: int) -> Continuation | None:
    """The step after `step` (which is running) as the scheduler would make it once its tokens
    are in, or None where that is not known now (see the module's rules). Allocates the
    continued sequences' next KV slots."""
    if scheduler.waiting or not step.sequences or len(step.sequences) > MAX_CONTINUED_SEQUENCES:
        return None
    kv = scheduler.kv
    if kv.num_groups > 1:
        return None
    plan, running = [], 0
    for row, seq in enumerate(step.sequences):  # every row samples, so rows are sampled rows
        request = requests.child(seq.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            if seq.sampling is None:
                return None
            continue  # it ended (or was aborted) while the step ran: no row after it
        if not _continued(request, seq, requests):
            return None
        running += 1
        next_position = seq.start + len(seq.token_ids)
        if (seq.sampling.num_output_tokens + 1 >= request.max_tokens
                or next_position + 1 >= max_model_len):
            continue  # the token the step samples is its last
        plan.append((request, seq, row, next_position))
    # the scheduler runs every running request each step (their decodes fit the budget): one
    # the running step left out (a budget spent on prompts) must not be left out again
    if not plan or running != len(scheduler.running):
        return None
    sequences, rows = [], []
    for request, seq, row, position in plan:
        if not kv.allocate_slots(request.request_id, position + 1, position):
            return None  # the pool is short: the scheduler decides who runs (and who waits)
        sampling = seq.sampling
        sequences.append(ScheduledSequence(
            request.request_id, [DRAFT_PLACEHOLDER], position, kv.block_ids(request.request_id),
            SamplingInputs(sampling.params, sampling.eos_token_ids, sampling.num_output_tokens + 1),
            state_slot=seq.state_slot))
        rows.append(row)
    return Continuation(SchedulerOutput(sequences), rows)
