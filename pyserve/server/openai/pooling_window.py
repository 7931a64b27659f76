"""One request's many pooling inputs, fed to the engine a window at a time.

The engine admits waiting requests first come, first served. A batch of inputs (up to 2,048 in
one /v1/embeddings, /pooling, /score or /rerank request) added all at once stood in the queue
before every request that came after it: a 2-token completion sent meanwhile waited for the
whole batch (issue 68: 25.7 s behind 256 inputs). Fed a window at a time, the batch's later
inputs join the queue as its earlier ones end, behind whatever arrived meanwhile, so a request
arriving during a batch waits behind one window at most, and then shares every step with the
batch's inputs under the step's token budget, as any two requests do.

The window is two steps' worth of the batch (2 x max_num_batched_tokens tokens, 2 x max_num_seqs
inputs; at least one input, however long): while one step runs, the next one's inputs already
wait, so a lone batch still fills every step. Every input is checked before the first is fed:
a bad input is refused (400) before any work is done, as when all were added at once."""

from __future__ import annotations

import torch

from pyserve.engine.async_engine import AsyncEngine
from pyserve.pooling_params import PoolingParams
from pyserve.server.errors import APIError


async def pool_in_windows(engine: AsyncEngine, inputs: list[tuple[str | None, list[int]]],
                          request_ids: list[str], params: PoolingParams,
                          priority: int) -> list[torch.Tensor]:
    """Each input's pooled output, in order. Raises InvalidRequest (a bad input, before any
    runs) or EngineDeadError; leaving early (a client gone) ends every input already fed."""
    for _, ids in inputs:
        engine.check_pooling_request(ids, params, priority)
    scheduler = engine.config.scheduler
    max_tokens, max_inputs = 2 * scheduler.max_num_batched_tokens, 2 * scheduler.max_num_seqs
    streams = []
    fed = in_flight = 0  # inputs fed so far; the tokens of those not yet pooled
    pooled = []
    try:
        for i, (_, ids) in enumerate(inputs):
            while fed < len(inputs) and (fed == i or (
                    fed - i < max_inputs and in_flight + len(inputs[fed][1]) <= max_tokens)):
                text, fed_ids = inputs[fed]
                streams.append((request_ids[fed], engine.add_pooling_request(
                    fed_ids, params, request_ids[fed], text, priority)))
                in_flight += len(fed_ids)
                fed += 1
            final = None
            async for final in streams[i][1]:
                pass
            if final is None or final.pooled is None:
                raise APIError(500, "the request was aborted before its embedding was computed")
            pooled.append(final.pooled)
            in_flight -= len(ids)
    finally:  # the client went away, a refusal, or done: nothing may keep running
        for request_id, _ in streams:
            engine.discard(request_id)
    return pooled
