"""The test-only fault hook ($PYSERVE_TEST_FAULT_STEP, engine/faults.py): the chosen model step
raises; that step's requests end with an error their streams (and HTTP clients) see, the books
count them as errored, and the engine recovers: later requests run, /health stays 200. We
recover rather than mark the engine dead (as vLLM does) because a failed step leaves nothing
behind that others could read: a block enters the prefix cache only after its step completed,
and the failed requests' blocks are freed at once."""

import asyncio
import json
import socket

import pytest
import uvloop

from pyserve.cli import parse_config
from pyserve.config import Config
from pyserve.engine.async_engine import AsyncEngine, EngineDeadError
from pyserve.engine.books import problems
from pyserve.engine.core import EngineCore
from pyserve.engine.faults import InjectedFault
from pyserve.sampling_params import RequestOutputKind, SamplingParams
from tests.e2e.server import ServerProcess, assert_books_balanced

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                        output_kind=RequestOutputKind.DELTA)


def test_the_fault_step_comes_only_from_the_environment(model_dir):
    assert parse_config(["--model", str(model_dir)], environ={}).scheduler.test_fault_step is None
    config = parse_config(["--model", str(model_dir)], environ={"PYSERVE_TEST_FAULT_STEP": "7"})
    assert config.scheduler.test_fault_step == 7
    for bad in ("0", "x", "-2"):
        with pytest.raises(SystemExit):
            parse_config(["--model", str(model_dir)], environ={"PYSERVE_TEST_FAULT_STEP": bad})
    with pytest.raises(SystemExit):  # no flag: a command line cannot turn it on by accident
        parse_config(["--model", str(model_dir), "--test-fault-step", "3"], environ={})
    assert EngineCore(parse_config(["--model", str(model_dir), "--kv-cache-memory", "16MiB"],
                                   environ={})).fault is None


def test_a_failed_step_errors_its_requests_and_the_engine_goes_on(model_dir):
    config = Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB", test_fault_step=3)
    core = EngineCore(config)

    async def consume(engine, request_id, ids):
        tokens = []
        try:
            async for out in engine.generate(ids, PARAMS, request_id):
                tokens += out.outputs[0].token_ids
        except EngineDeadError as exc:
            return "error", str(exc), tokens
        return "ok", None, tokens

    async def main():
        engine = AsyncEngine(core)
        ids = core.tokenizer.encode("The quick brown fox")
        first = await asyncio.gather(*(consume(engine, f"r{i}", ids) for i in range(3)))
        # the three ran together; steps 1 and 2 gave each two tokens, step 3 failed them all
        assert [kind for kind, _, _ in first] == ["error"] * 3
        assert all("fault injected at model step 3" in message for _, message, _ in first)
        assert all(len(tokens) == 2 for _, _, tokens in first)
        assert engine.alive and engine.dead_reason is None
        after = await asyncio.gather(*(consume(engine, f"s{i}", ids) for i in range(2)))
        assert after == [("ok", None, after[0][2])] * 2 and len(after[0][2]) == 8
        await asyncio.sleep(0)
        books = engine.books(count_references=True)
        assert books["requests_errored"] == 3 and books["requests_finished"] == 2
        assert books["requests_aborted"] == 0 and problems(books) == []
        await engine.shutdown()
    uvloop.run(main())
    with pytest.raises(InjectedFault):  # the offline path sees the fault as it is
        faulty = EngineCore(Config.from_flat(model=str(model_dir), kv_cache_memory="16MiB",
                                             test_fault_step=1))
        faulty.add_request("x", faulty.tokenizer.encode("Hi"), PARAMS)
        faulty.step()


def _http(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def _post(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
            % (len(payload), payload))


def test_over_http_the_client_sees_the_error_and_the_books_count_it(model_dir):
    server = ServerProcess("--model", str(model_dir), "--enable-debug-endpoints",
                           "--kv-cache-memory", "16MiB", env={"PYSERVE_TEST_FAULT_STEP": "2"})
    try:
        body = {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
        streamed = _http(server.port, _post({**body, "stream": True}))
        assert b"HTTP/1.1 200" in streamed
        events = [line[6:] for line in streamed.split(b"\n") if line.startswith(b"data: ")]
        errors = [json.loads(e) for e in events if e != b"[DONE]" and b'"error"' in e]
        assert len(errors) == 1 and "fault injected" in errors[0]["error"]["message"]
        assert not any(b'"finish_reason":"length"' in e for e in events)  # it did not finish
        answered = _http(server.port, _post(body))  # step 3 on: no fault, a whole answer
        assert answered.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length"' in answered
        assert _http(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                     ).startswith(b"HTTP/1.1 200")
        books = assert_books_balanced(server.url)
        assert books["requests_errored"] == 1 and books["requests_finished"] == 1
    finally:
        assert server.stop() == 0


def test_a_non_streaming_client_gets_a_500_and_the_server_goes_on(model_dir):
    server = ServerProcess("--model", str(model_dir), "--enable-debug-endpoints",
                           "--kv-cache-memory", "16MiB", env={"PYSERVE_TEST_FAULT_STEP": "1"})
    try:
        body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        failed = _http(server.port, _post(body))
        assert failed.startswith(b"HTTP/1.1 500") and b'"choices"' not in failed
        assert _http(server.port, _post(body)).startswith(b"HTTP/1.1 200")
        books = assert_books_balanced(server.url)
        assert books["requests_errored"] == 1 and books["requests_finished"] == 1
    finally:
        assert server.stop() == 0
