"""Draft-model proposals for speculative decoding (vLLM's "draft_model" method): a smaller
model with the target's vocabulary proposes each speculating sequence's drafts greedily, on
the model thread, just before the target's step verifies them.

The draft's paged KV cache is a sibling of the target's: the same number of blocks of the same
size, so a request's block table addresses both, and the blocks the scheduler allocated for a
step's drafts hold the draft's K/V of them too. What the draft's cache lacks of a request (its
whole context at first, then the tokens verification appended) comes with the step as the
request's draft context; the scheduler tracks how much of it is right (Request.draft_synced),
so a rejected draft's K/V is simply overwritten later, as the target's is.

The proposal is a point mass on the draft's argmax, which the verifier's rejection sampling
(accept a draft when the target's own draw equals it) keeps exact for sampled requests.

Under a grammar (structured outputs), the sequence brings a fork of its matcher: the draft
proposes its argmax among the tokens the grammar allows, the fork accepts each proposal, and
its states give the verify rows their masks (row i: what the grammar allows after the first
i drafts), as the engine's own walk does for n-gram drafts, which exist before the step."""

from __future__ import annotations

from pyserve.model.runner import DraftModelRequest, ModelRunner, PreparedBatch
from pyserve.sampling_params import SamplingParams
from pyserve.step import SamplingInputs, ScheduledSequence, SchedulerOutput
from pyserve.structured.bitmask import fill_bitmask

_GREEDY = SamplingInputs(SamplingParams(temperature=0.0, max_tokens=1), (), 0)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.num_forwards = 0  # draft forward passes run (one per draft position proposed)

    def propose(self, batch: PreparedBatch) -> None:
        """Fills the placeholders of batch's draft-model sequences (their drafts and the
        input rows that carry them) with the draft's greedy continuation: one forward over
        every sequence's context, then one per further draft position."""
        requests = batch.draft_model
        if not requests:
            return
        seqs = [ScheduledSequence(r.request_id, r.context, r.context_start, r.block_ids, _GREEDY)
                for r in requests]
        proposed = [0] * len(requests)
        verify_states = {r.verify_row: r.grammar.fork() for r in requests if r.grammar is not None}
        active = list(range(len(requests)))
        while active:
            tokens = self._greedy(seqs, {n: requests[i].grammar for n, i in enumerate(active)
                                         if requests[i].grammar is not None})
            still = []
            for i, token in zip(active, tokens):
                r = requests[i]
                drafts = batch.drafts[r.drafts_index]
                j = proposed[i]
                drafts[j] = token
                batch.inputs.input_ids[r.first_row + j] = token
                proposed[i] = j + 1
                if r.grammar is not None:  # the token is one its mask allowed
                    if r.grammar.accept_token(token) and not r.grammar.is_terminated():
                        verify_states[r.verify_row + j + 1] = r.grammar.fork()
                    else:
                        # the grammar ended with this draft (so does the request, if the
                        # target keeps it) or refused it (its row's mask rejects it there):
                        # the rows after are never read, and keep their placeholders
                        continue
                if j + 1 < len(drafts):
                    still.append(i)
            active = still
            seqs = [self._next(requests[i], batch.drafts[requests[i].drafts_index], proposed[i])
                    for i in active]
        if verify_states:
            # every drafts row is a draft model's (the method is the engine's), so nothing
            # else masked them
            rows = sum(len(d) + 1 for d in batch.drafts)
            batch.draft_grammar = (fill_bitmask(verify_states, rows, self.runner.vocab_size),
                                   sorted(verify_states))

    @staticmethod
    def _next(r: DraftModelRequest, drafts: list[int], proposed: int) -> ScheduledSequence:
        """The draft's step that reads its last proposal and yields the next one."""
        position = r.context_start + len(r.context) + proposed - 1
        return ScheduledSequence(r.request_id, [drafts[proposed - 1]], position, r.block_ids, _GREEDY)

    def _greedy(self, seqs: list[ScheduledSequence], grammars: dict[int, object]) -> list[int]:
        """The draft's argmax for each sequence; grammars: row -> the matcher masking it."""
        step = SchedulerOutput(seqs)
        if grammars:
            step.grammar_bitmask = fill_bitmask(grammars, len(seqs), self.runner.vocab_size)
            step.constrained_rows = sorted(grammars)
        out = self.runner.run(self.runner.prepare(step))
        self.num_forwards += 1
        return list(out.sampled.token_ids)
