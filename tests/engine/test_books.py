"""The engine's books (engine/books.py): every accepted request ends exactly once, as finished,
aborted or errored, and an idle engine holds no per-request state and no KV block; a leak is
named. GET /debug/books answers only with --enable-debug-endpoints."""

import asyncio

import orjson
import pytest
import uvloop

from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.books import RequestCounts, problems
from pyserve.engine.core import EngineCore
from pyserve.sampling_params import SamplingParams
from pyserve.server.app import ServerState, _build_routes
from pyserve.server.http import Request


@pytest.fixture(scope="module")
def config(model_dir):
    return Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def core(config):
    return EngineCore(config)


def run_until_idle(core):
    while core.has_unfinished():
        core.step()


def test_every_request_ends_once_and_an_idle_engine_holds_nothing(core):
    before = core.books()
    prompt = core.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    core.add_request("done", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    core.add_request("n2", prompt, SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=4))
    core.add_request("gone", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    core.add_request("broken", prompt[:5], SamplingParams(temperature=0.0, max_tokens=40))
    core.step()
    running = core.books(count_references=True)
    assert running["kv_blocks_referenced"] > 0 and running["requests_in_table"] == 4
    assert running["kv_blocks_with_references"] == running["kv_blocks_referenced"]
    assert any("requests_in_table" in p for p in problems(running))  # not idle: not balanced
    core.abort("gone")
    core.abort("broken", "errored")
    core.abort("gone")  # a second abort is no second terminal event
    run_until_idle(core)
    books = core.books(count_references=True)
    delta = {k: books[k] - before[k] for k in ("requests_accepted", "requests_finished",
                                               "requests_aborted", "requests_errored")}
    assert delta == {"requests_accepted": 4, "requests_finished": 2, "requests_aborted": 1,
                     "requests_errored": 1}
    assert problems(books) == []
    assert books["kv_blocks_with_references"] == 0 and books["kv_blocks_cached"] > 0  # cached, free
    assert books["runner_requests"] <= books["runner_ends_pending"]  # seeded: until the next step
    # blocks ever handed out: at least those the run held at once, never above the pool, and a
    # finished run returns none of them (the pool's memory stays written)
    assert running["kv_blocks_referenced"] <= books["kv_blocks_touched"] <= books["kv_blocks_total"]
    assert books["kv_blocks_touched"] >= running["kv_blocks_touched"] > 0
    assert books["kv_bytes_per_block"] > 0
    pool_bytes = books["kv_blocks_total"] * books["kv_bytes_per_block"]
    assert 0 < books["kv_pool_resident_bytes"] <= pool_bytes + 8192  # written pages, whole ones


def test_a_leak_is_named(core):
    run_until_idle(core)
    assert core.kv.allocate_slots("leaked", 40)
    try:
        found = problems(core.books(count_references=True))
        assert any("kv_blocks_referenced" in p for p in found)
        assert any("kv_manager_requests" in p for p in found)
        assert any("ref count above 0" in p for p in found)
    finally:
        core.kv.forget("leaked")
    assert problems(core.books(count_references=True)) == []
    books = core.books()
    assert problems({**books, "requests_accepted": books["requests_accepted"] + 1})  # unaccounted


def test_an_unknown_terminal_event_is_refused():
    with pytest.raises(ValueError, match="terminal event"):
        RequestCounts().on_ended("vanished")


def test_a_failed_step_ends_its_requests_as_errored(core):
    """A step that raises fails its requests (one terminal event each), the engine goes on."""
    from pyserve.engine.async_engine import EngineDeadError

    async def main():
        engine = AsyncEngine(core)
        before = core.books()
        real_run = core.run
        core.run = lambda prepared: (_ for _ in ()).throw(RuntimeError("injected"))
        prompt = core.tokenizer.encode("Hello there")
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        try:
            with pytest.raises(EngineDeadError, match="injected"):
                async for _ in engine.generate(prompt, params, "doomed"):
                    pass
        finally:
            core.run = real_run
        async for _ in engine.generate(prompt, params, "after"):  # the engine recovered
            pass
        books = engine.books(count_references=True)
        engine._task.cancel()
        return before, books

    before, books = uvloop.run(main())
    assert books["requests_errored"] - before["requests_errored"] == 1
    assert books["requests_finished"] - before["requests_finished"] == 1
    assert problems(books) == []


def test_async_streams_balance_and_the_debug_route(core, config):
    async def main():
        engine = AsyncEngine(core)
        prompt = core.tokenizer.encode("Hello there, how are you?")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        async for _ in engine.generate(prompt, params, "whole"):
            pass
        async for _ in engine.generate(prompt, params, "left-early"):
            break  # the client left: its request is aborted
        await asyncio.sleep(0.05)
        books = engine.books(count_references=True)
        off = ServerState(config)
        on = ServerState(Config.from_flat(model=config.model.model, enable_debug_endpoints=True))
        for state in (off, on):
            state.engine, state.phase = engine, "ready"
            state.router = _build_routes(state, engine)
        hidden = await off.handle(Request("GET", "/debug/books", {}))
        shown = await on.handle(Request("GET", "/debug/books", {}))
        await engine.shutdown()
        return books, hidden, shown

    books, hidden, shown = uvloop.run(main())
    assert books["streams_open"] == 0 and problems(books) == []
    assert hidden.status == 404
    body = orjson.loads(shown.body)
    assert shown.status == 200 and body["balanced"] and body["idle"] and body["problems"] == []
    assert body["books"]["streams_open"] == 0 and body["books"]["requests_aborted"] >= 1
