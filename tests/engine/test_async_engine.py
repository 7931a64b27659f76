"""The async engine on a real uvloop loop: concurrent streams, staggered arrivals, deltas that
add up, aborts at any point, and a loop that stays responsive while the model runs."""

import asyncio
import logging
import dataclasses

import pytest
import uvloop

from pyserve import LLM, SamplingParams
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.sampling_params import RequestOutputKind

PROMPTS = ["Hello, world!", "The quick brown fox jumps over", "Paris is the capital of", "0 1 2 3",
           "Tokyo is the capital of Japan. Python, C++ and CUDA.", "A paged KV cache"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def alone(model_dir):
    """Each prompt's greedy output when run by itself."""
    llm = LLM(str(model_dir), kv_cache_memory="16MiB")
    return {p: llm.generate(p, GREEDY)[0].outputs[0] for p in PROMPTS}


def run(coro):
    return uvloop.run(coro)


async def collect(engine, tokenizer, prompt, params, request_id, delay=0.0):
    await asyncio.sleep(delay)
    text, ids, finish = "", [], None
    async for out in engine.generate(tokenizer.encode(prompt), params, request_id):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
        finish = out.outputs[0].finish_reason
    return text, ids, finish


def test_staggered_concurrent_requests_match_running_alone(model_dir, alone, caplog):
    from pyserve.config import Config

    caplog.set_level(logging.INFO, logger="pyserve")

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                           max_num_batched_tokens=16, log_stats_interval=0.001))
        engine = AsyncEngine(core)
        tok = core.tokenizer
        results = await asyncio.gather(*(
            collect(engine, tok, p, GREEDY, f"r{i}", delay=0.01 * i) for i, p in enumerate(PROMPTS)))
        await engine.shutdown()
        return core, engine, results

    core, engine, results = run(main())
    for prompt, (text, ids, finish) in zip(PROMPTS, results):
        assert ids == alone[prompt].token_ids
        assert text == alone[prompt].text == core.tokenizer.decode(ids, skip_special_tokens=True)
        assert finish == "length"
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert 0.0 < engine.loop_busy_fraction < 1.0
    snap = core.snapshot()
    assert snap["finished_requests"] == len(PROMPTS) and snap["num_running"] == 0
    assert snap["generation_tokens_total"] == sum(len(ids) for _, ids, _ in results)
    assert snap["ttft_p50_s"] > 0 and snap["itl_p50_s"] > 0 and len(core.stats.ttft_s) == len(PROMPTS)
    assert any("generation tok/s" in r.getMessage() for r in caplog.records)


def test_aborts_at_any_point_free_everything_and_spare_the_others(model_dir, alone):
    from pyserve.config import Config

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                           max_num_batched_tokens=8))
        engine = AsyncEngine(core)
        tok = core.tokenizer
        survivors = [asyncio.create_task(collect(engine, tok, p, GREEDY, f"keep{i}"))
                     for i, p in enumerate(PROMPTS[:3])]

        async def consume_then_leave(request_id, prompt, n_outputs):
            got = 0
            async for _ in engine.generate(tok.encode(prompt), GREEDY, request_id):
                got += 1
                if got >= n_outputs:
                    break  # the client goes away mid-stream

        # before scheduling (abort right away), mid-prefill (8-token chunks), mid-decode
        early = asyncio.create_task(collect(engine, tok, PROMPTS[4], GREEDY, "early"))
        while not engine.is_active("early"):
            await asyncio.sleep(0)
        engine.abort("early")
        await consume_then_leave("mid-decode", PROMPTS[5], 5)
        task = asyncio.create_task(collect(engine, tok, PROMPTS[4] * 3, GREEDY, "mid-prefill"))
        await asyncio.sleep(0.005)
        task.cancel()
        results = await asyncio.gather(*survivors)
        early_result = await early
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.shutdown()
        return core, results, early_result

    core, results, early_result = run(main())
    assert early_result[2] == "abort"
    for prompt, (text, ids, _) in zip(PROMPTS[:3], results):
        assert ids == alone[prompt].token_ids
    assert not core.has_unfinished()
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_an_id_used_again_right_after_an_abort_names_a_request_of_its_own(model_dir, alone):
    """A caller that gives up on a request and at once sends another under the same id: the
    aborted request's step still running, and its stream still open, touch neither the new
    request's tokens nor its stream. A live request's id stays refused."""
    from pyserve.config import Config
    from pyserve.errors import InvalidRequest

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB"))
        engine = AsyncEngine(core)
        tok = core.tokenizer
        first = engine.generate(tok.encode(PROMPTS[1]), GREEDY, "same")
        for _ in range(3):
            await first.__anext__()  # its next step is likely running now
        with pytest.raises(InvalidRequest, match="already in use"):
            engine.add_request(tok.encode(PROMPTS[2]), GREEDY, "same")
        engine.abort("same")
        again = engine.add_request(tok.encode(PROMPTS[2]), GREEDY, "same")
        left = [out async for out in first]  # the abort row; the new request's queue stays
        ids, finish = [], None
        async for out in again:
            assert out.request_id == "same"
            ids += out.outputs[0].token_ids
            finish = out.outputs[0].finish_reason
        books = engine.books()
        active = engine.is_active("same")
        await engine.shutdown()
        return core, left, ids, finish, books, active

    core, left, ids, finish, books, active = run(asyncio.wait_for(main(), 120))
    assert left[-1].outputs[0].finish_reason == "abort" and left[-1].request_id == "same"
    assert ids == alone[PROMPTS[2]].token_ids and finish == "length"
    assert not core.has_unfinished() and core.kv.num_free_blocks == core.kv.num_blocks
    assert books["streams_open"] == 0 and not active


def test_refused_request_raises_before_streaming(model_dir):
    from pyserve.config import Config

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                           max_model_len=64))
        engine = AsyncEngine(core)
        with pytest.raises(ValueError, match="maximum context length"):
            async for _ in engine.generate([5] * 60, dataclasses.replace(GREEDY, max_tokens=10), "x"):
                pass
        await engine.shutdown()
        return core

    core = run(main())
    assert core.kv.num_free_blocks == core.kv.num_blocks


def test_loop_stays_responsive_while_the_model_runs(model_dir):
    """A 1 ms timer on the event loop fires while a step is inside the model: the forward runs
    in the model thread, not on the loop. (Each forward is stretched by 5 ms so that a tick
    can land inside it however fast the machine is; a loop blocked by the forward could only
    tick between steps.)"""
    import threading
    import time as clock

    from pyserve.config import Config

    async def main():
        core = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB"))
        in_model = threading.Event()
        forward = core.run

        def slow_run(prepared):
            in_model.set()
            try:
                clock.sleep(0.005)
                return forward(prepared)
            finally:
                in_model.clear()

        core.run = slow_run
        engine = AsyncEngine(core)
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                await asyncio.sleep(0.001)
                ticks += in_model.is_set()

        t = asyncio.create_task(ticker())
        await collect(engine, core.tokenizer, PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=64), "a")
        done = True
        await t
        await engine.shutdown()
        return ticks, engine.num_steps

    ticks, steps = run(main())
    assert steps >= 64 and ticks > 0
