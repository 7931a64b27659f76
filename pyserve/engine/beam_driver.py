"""Beam search (engine/beam_search.py) run through the real engine: each round, every live
beam is a one-token request with 2 x beam_width logprobs; the round ends when all have
answered. The offline LLM steps its EngineCore itself (run_offline); the server's AsyncEngine
iterates the requests' streams on the event loop (stream), so no round blocks it.

A search is checked before anything runs (InvalidRequest, as admission words it). However a
round ends (a client gone, an engine failure), its requests are aborted: no beam keeps KV
blocks. Output shapes: vLLM's BeamSearchOutput offline (the whole token list decoded); on the
server one RequestOutput with a CompletionOutput per beam, as vLLM's online beam search: the
generated tokens (a final EOS only with include_stop_str_in_output), the text without it."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pyserve.engine.admission import check_admissible
from pyserve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchSequence, StopCheck
from pyserve.engine.output import CompletionOutput, PositionLogprobs, RequestOutput
from pyserve.errors import InvalidRequest
from pyserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


def round_params(params: BeamSearchParams) -> SamplingParams:
    """One beam's request in a round (vLLM's: max_tokens 1, logprobs 2 x beam_width)."""
    return SamplingParams(max_tokens=1, temperature=params.temperature, seed=params.seed,
                          logprobs=2 * params.beam_width, output_kind=RequestOutputKind.FINAL_ONLY)


def stop_string_check(tokenizer, params: BeamSearchParams, prompt_len: int) -> StopCheck | None:
    """Whether a beam's text now holds a stop string: its last tokens are decoded, enough of
    them for the longest stop string (a token is at least a byte, a character at most four),
    so a round costs beam_width short decodes."""
    if not params.stop:
        return None
    window = 4 * max(len(s) for s in params.stop) + 2

    def check(beam: BeamSearchSequence) -> str | None:
        tail = tokenizer.decode(beam.tokens[max(prompt_len, len(beam.tokens) - window):],
                                skip_special_tokens=params.skip_special_tokens)
        return next((s for s in params.stop if s in tail), None)
    return check


def start(core, prompt_token_ids: list[int], params: BeamSearchParams,
          priority: int = 0) -> BeamSearch:
    """A search ready for its first round, or InvalidRequest saying why it can never run."""
    limits = core.admission.limits
    if priority != 0 and not limits.priority_scheduling:
        raise InvalidRequest("priority", f"priority {priority} was given, but priority "
                             "scheduling is not enabled (--scheduling-policy priority)")
    asked = 2 * params.beam_width
    allowed = limits.vocab_size if limits.max_logprobs == -1 else limits.max_logprobs
    if asked > allowed:
        raise InvalidRequest("n", f"beam search with a beam width (n) of {params.beam_width} asks "
                             f"for {asked} logprobs a step, more than --max-logprobs ({allowed}); "
                             f"use n <= {allowed // 2}")
    check_admissible(list(prompt_token_ids), SamplingParams(max_tokens=params.max_tokens), limits)
    stop = stop_string_check(core.tokenizer, params, len(prompt_token_ids))
    return BeamSearch(list(prompt_token_ids), params, core.tokenizer.eos_token_id,
                      core.max_model_len, stop)


def _position(output: RequestOutput | None) -> PositionLogprobs | None:
    """A round's answer for one beam: the logprobs of its one token (None: it was aborted)."""
    if output is None or not output.outputs or not output.outputs[0].logprobs:
        return None
    return output.outputs[0].logprobs[0]


# -- offline -----------------------------------------------------------------------------------
def run_offline(core, searches: list[BeamSearch], prefix: str) -> list[BeamSearchOutput]:
    """Runs every search to its end, all prompts' beams of a round in the same steps (the
    core must have no other requests); returns vLLM's BeamSearchOutput per search."""
    round_ = 0
    while live := [(i, s) for i, s in enumerate(searches) if not s.finished]:
        ids: list[str] = []
        try:
            for i, search in live:
                params = round_params(search.params)
                for b, beam in enumerate(search.beams):
                    ids.append(f"{prefix}-{i}-{round_}-{b}")
                    core.add_request(ids[-1], beam.tokens, params)
            finals: dict[str, RequestOutput] = {}
            while core.has_unfinished():
                for out in core.step():
                    finals[out.request_id] = out
        except BaseException:
            for rid in ids:
                core.abort(rid)
            raise
        for i, search in live:
            search.advance([_position(finals.get(f"{prefix}-{i}-{round_}-{b}"))
                            for b in range(len(search.beams))])
        round_ += 1
    outputs = []
    for search in searches:
        best = search.best()
        for beam in best:  # vLLM's LLM.beam_search decodes the whole sequence, prompt included
            beam.text = core.tokenizer.decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs


# -- the server ----------------------------------------------------------------------------------
async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    final = None
    async for final in stream:
        pass
    return final


async def stream(engine, search: BeamSearch, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], priority: int = 0) -> AsyncIterator[RequestOutput]:
    """The search on the async engine: one output, when it is done, with the n best beams."""
    params = round_params(search.params)
    round_ = 0
    while not search.finished:
        streams = []
        try:
            for b, beam in enumerate(search.beams):
                rid = f"{request_id}-beam{round_}-{b}"
                streams.append((rid, engine.add_request(beam.tokens, params, rid, priority=priority)))
            positions = [_position(await _final(it)) for _, it in streams]
        finally:  # a cancelled round (the client gone) frees every beam's request
            for rid, _ in streams:
                engine.discard(rid)
        search.advance(positions)
        round_ += 1
    yield online_output(search, request_id, prompt, prompt_token_ids, engine.tokenizer)


def _shown_logprobs(beam: BeamSearchSequence, generated: list[int], k: int) -> list[PositionLogprobs]:
    """Each position as the engine shapes a sampled token's: the chosen token, then the k
    most likely (k -1: all the round returned)."""
    out = []
    for token, position in zip(generated, beam.logprobs):
        entry = {token: position[token]}
        for alt, lp in position.items():
            if alt not in entry and (k == -1 or 1 <= lp.rank <= k):
                entry[alt] = lp
        out.append(entry)
    return out


def online_output(search: BeamSearch, request_id: str, prompt: str | None,
                  prompt_token_ids: list[int], tokenizer) -> RequestOutput:
    p = search.params
    outputs = []
    for i, beam in enumerate(search.best()):
        generated = search.generated(beam)
        by_token = beam.finish_reason == "stop" and isinstance(beam.stop_reason, int)
        text = tokenizer.decode(generated[:-1] if by_token else generated,
                                skip_special_tokens=p.skip_special_tokens)
        if isinstance(beam.stop_reason, str):  # cut at the stop string, as sampling does
            at = text.find(beam.stop_reason)
            if at >= 0:
                text = text[:at + (len(beam.stop_reason) if p.include_stop_str_in_output else 0)]
        token_ids = generated[:-1] if by_token and not p.include_stop_str_in_output else generated
        logprobs = None if p.logprobs is None else _shown_logprobs(beam, generated, p.logprobs)
        outputs.append(CompletionOutput(i, text, token_ids, beam.finish_reason or "length",
                                        beam.stop_reason, logprobs, beam.cum_logprob))
    return RequestOutput(request_id, prompt, list(prompt_token_ids), outputs, finished=True)
