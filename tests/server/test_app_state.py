"""Server state without sockets: health phases and the stall rule, and tokenization of large
inputs off the event loop."""

import threading
import time

import orjson
import pytest
import uvloop

from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.sampling_params import SamplingParams
from pyserve.server.app import STALL_LIMIT_S, ServerState
from pyserve.server.http import Request
from pyserve.server.openai.serving import _OFF_LOOP_CHARS, OpenAIServing


@pytest.fixture(scope="module")
def config(tiny_model_factory):
    return Config.from_flat(model=str(tiny_model_factory("llama")), kv_cache_memory="16MiB")


def health(state):
    response = uvloop.run(state.handle(Request("GET", "/health", {})))
    return response.status, orjson.loads(response.body)


def test_health_phases_and_stall(config):
    state = ServerState(config)
    assert health(state) == (503, {"status": "loading"})

    async def main():
        engine = AsyncEngine(EngineCore(config))
        engine.start()
        state.engine, state.phase = engine, "ready"
        ok = await state.handle(Request("GET", "/health", {}))
        stream = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4), "r")
        engine.last_progress = time.monotonic() - STALL_LIMIT_S - 1  # work pending, no step for long
        stalled = await state.handle(Request("GET", "/health", {}))
        engine.abort("r")
        await stream.aclose()
        await engine.shutdown()
        dead = await state.handle(Request("GET", "/health", {}))
        return ok.status, stalled.status, orjson.loads(stalled.body), dead.status, orjson.loads(dead.body)

    assert uvloop.run(main()) == (200, 503, {"status": "stalled"}, 503, {"status": "dead"})


def test_large_inputs_are_tokenized_off_the_loop(config):
    async def main():
        engine = AsyncEngine(EngineCore(config))
        serving = OpenAIServing(engine, config.server)
        threads = []
        real_encode = serving.tokenizer.encode

        def recording_encode(text, **kwargs):
            threads.append(threading.current_thread())
            return real_encode(text, **kwargs)

        serving.tokenizer.encode = recording_encode
        try:
            await serving._encode("short")
            big = await serving._encode("word " * (_OFF_LOOP_CHARS // 4))
        finally:
            del serving.tokenizer.encode
        await engine.shutdown()
        return threads, big

    threads, big = uvloop.run(main())
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()
    assert len(big) > 1000


def test_a_failure_after_the_stream_started_ends_it_with_an_error_event(config):
    """The model step fails on its third call (injected): the open stream gets an SSE error
    event, then [DONE], and the engine frees the request."""
    from pyserve.server.http import StreamingResponse

    async def main():
        core = EngineCore(config)
        engine = AsyncEngine(core)
        serving = OpenAIServing(engine, config.server)
        calls = {"n": 0}
        real_run = core.run

        def failing_run(prepared):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected device failure")
            return real_run(prepared)

        core.run = failing_run
        body = orjson.dumps({"prompt": "Hello", "max_tokens": 10, "stream": True, "ignore_eos": True})
        response = await serving.completions(Request("POST", "/v1/completions", {}, body))
        assert isinstance(response, StreamingResponse)
        chunks = [c async for c in response.chunks]
        await engine.shutdown()
        return core, chunks

    core, chunks = uvloop.run(main())
    assert chunks[-1] == b"data: [DONE]\n\n"
    error = orjson.loads(chunks[-2][len(b"data: "):])
    assert "injected device failure" in error["error"]["message"]
    assert any(b'"text"' in c for c in chunks[:-2])  # the stream had started
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.has_unfinished()
