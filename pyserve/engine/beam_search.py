"""Beam search as vLLM runs it, above the engine, as a pure state machine: BeamSearch holds one
prompt's beams and advances them a round at a time from the logprobs the engine returns;
engine/beam_driver.py runs those rounds through the real engine (the offline LLM's core, the
server's async engine). vLLM: BeamSearchOnlineMixin.beam_search and LLM.beam_search
(BeamSearchOfflineMixin), vllm/beam_search.py's get_beam_search_score.

One round per generated token:
  - every live beam is a request for one token with the logprobs of its 2 x beam_width most
    likely next tokens (plus the token the engine sampled: at temperature 0 the top one);
    prefix caching serves the beams' shared prefixes;
  - each (beam, token) is a candidate scored cum_logprob + logprob; a candidate whose token is
    EOS (unless ignore_eos) or a stop token id is a finished beam, kept however it ranks;
  - the beam_width best other candidates by cumulative logprob are the next live beams (a
    stable sort: ties keep the engine's order); one whose text now holds a stop string
    finishes there;
  - after max_tokens rounds, or at the model length, the live beams finish ("length"). Every
    finished beam is ranked by cum_logprob / len(tokens) ** length_penalty, len counting the
    prompt and not a final EOS, and the beam_width best are the result.

Invariants: at most beam_width live beams, all of one length; a beam's tokens are the prompt
then its generated tokens, a stop token kept last; logprobs[i] is the position dict its i-th
generated token was chosen from (the engine's, shared between siblings, never mutated)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyserve.engine.output import PositionLogprobs
from pyserve.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """vLLM's: tokens include the prompt; text is filled when the beam is returned."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def extended(self, token: int, position: PositionLogprobs, cum_logprob: float) -> "BeamSearchSequence":
        return BeamSearchSequence(self.tokens + [token], self.logprobs + [position], cum_logprob)


@dataclass
class BeamSearchOutput:
    """vLLM's: the best sequences, best first, at most beam_width of them."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): the cumulative logprob over the length to the power
    length_penalty; the length counts the prompt, and not a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (length ** length_penalty)


Candidate = tuple[float, int, BeamSearchSequence, PositionLogprobs]


def select(candidates: list[Candidate], width: int) -> list[Candidate]:
    """The width best candidates by cumulative logprob, best first; ties keep their order."""
    return sorted(candidates, key=lambda c: -c[0])[:width]


# beam -> the stop string its text now holds, or None
StopCheck = Callable[[BeamSearchSequence], str | None]


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None, max_model_len: int, stop_check: StopCheck | None = None):
        self.params = params
        self.prompt_len = len(prompt_token_ids)
        room = max_model_len - self.prompt_len  # each round's request needs room for its token
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.eos_token_id = eos_token_id
        self.stop_tokens = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            self.stop_tokens.add(eos_token_id)
        self.stop_check = stop_check
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0
        if self.max_tokens < 1:
            self._finish_live()

    @property
    def finished(self) -> bool:
        return not self.beams

    def advance(self, positions: list[PositionLogprobs | None]) -> None:
        """One round: positions[i] is live beam i's next-token logprobs, None where its request
        ended without a token (aborted): then the search ends there, as vLLM's does."""
        if len(positions) != len(self.beams):
            raise ValueError(f"{len(positions)} results for {len(self.beams)} beams")
        if any(p is None for p in positions):
            for beam in self.beams:
                beam.finish_reason = "abort"
            self.completed.extend(self.beams)
            self.beams = []
            return
        candidates: list[Candidate] = []
        for beam, position in zip(self.beams, positions):
            for token, logprob in position.items():
                cum = beam.cum_logprob + logprob.logprob
                if token in self.stop_tokens:
                    done = beam.extended(token, position, cum)
                    done.finish_reason, done.stop_reason = "stop", token
                    self.completed.append(done)
                else:
                    candidates.append((cum, token, beam, position))
        self.beams = []
        for cum, token, beam, position in select(candidates, self.params.beam_width):
            new = beam.extended(token, position, cum)
            stop = self.stop_check(new) if self.stop_check is not None else None
            if stop is None:
                self.beams.append(new)
            else:
                new.finish_reason, new.stop_reason = "stop", stop
                self.completed.append(new)
        self.num_steps += 1
        if self.num_steps >= self.max_tokens:
            self._finish_live()

    def _finish_live(self) -> None:
        for beam in self.beams:
            beam.finish_reason = "length"
        self.completed.extend(self.beams)
        self.beams = []

    def best(self) -> list[BeamSearchSequence]:
        """The result once finished: the beam_width best finished beams, best first."""
        p = self.params
        return sorted(self.completed, reverse=True, key=lambda b: get_beam_search_score(
            b.tokens, b.cum_logprob, self.eos_token_id, p.length_penalty))[:p.beam_width]

    def generated(self, beam: BeamSearchSequence) -> list[int]:
        return beam.tokens[self.prompt_len:]
