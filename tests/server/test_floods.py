"""Floods at CI size, over real sockets to real servers (the tiny model, so that the machine's
time goes to connections, not matrix products): hundreds of concurrent SSE streams with slow
readers while /health stays quick, half-open (slowloris) connections closed at the header
timeout while normal clients are served, the waiting-queue bound (--max-num-queued-requests)
answering 429 with Retry-After at once, SIGTERM during a flood draining within
--shutdown-timeout, and the open-file limit raised at start-up. benchmarks/stress.py runs the
same phases at full size (2,000 streams, 1,000 half-open connections). Timing bounds are
generous: they catch blow-ups, not regressions."""

import asyncio
import resource
import subprocess
import sys
import time

import pytest
import uvloop

from benchmarks import stress
from benchmarks.raw_http import post, request_json
from benchmarks.server_process import PyserveServer


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_the_open_file_limit_is_raised_to_the_hard_limit_at_start_up():
    code = ("import logging, resource; logging.basicConfig(level=logging.INFO);"
            "from pyserve.server.fd_limit import raise_open_file_limit;"
            "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    done = subprocess.run([sys.executable, "-c", code], preexec_fn=lowered, capture_output=True,
                          text=True, timeout=60)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    assert done.stdout.split() == [str(target), str(target)]
    assert f"raised from 256 to {target}" in done.stderr


def test_hundreds_of_streams_with_slow_readers_and_a_quick_health(tiny):
    server = PyserveServer("--model", tiny, "--kv-cache-memory", "64MiB")
    try:
        figures = uvloop.run(stress.phase_streams(server.port, server, 300, ramp=300.0,
                                                  slow_fraction=0.1, max_tokens=16))
        print(figures)
        assert figures["completed"] == 300 and figures["failed"] == 0, figures["first_errors"]
        assert figures["peak_streams_held_client"] >= 150  # the streams overlapped
        assert figures["health"]["failures"] == 0 and figures["health"]["count"] > 10
        assert figures["health"]["p99_ms"] < 1000  # 50 ms when the machine is quiet
        server.wait_balanced()
    finally:
        assert server.stop() == 0


def test_half_open_connections_are_closed_at_the_header_timeout(tiny):
    server = PyserveServer("--model", tiny, "--kv-cache-memory", "64MiB", "--header-timeout", "1")
    try:
        figures = uvloop.run(stress.phase_half_open(server.port, 200, header_timeout=1.0))
        print(figures)
        assert figures["closed_by_server_at_header_timeout"] == 200, figures["not_closed"]
        assert figures["normal_requests"]["count"] >= 3  # served meanwhile
        assert figures["normal_requests"]["max_ms"] < 5000
        assert figures["health"]["failures"] == 0 and figures["health"]["p99_ms"] < 1000
        server.wait_balanced()
    finally:
        assert server.stop() == 0


def test_the_queue_bound_answers_429_with_retry_after_instead_of_hanging(tiny):
    server = PyserveServer("--model", tiny, "--kv-cache-memory", "64MiB",
                           "--max-num-queued-requests", "2", "--max-num-seqs", "1")
    try:
        figures = uvloop.run(stress.phase_overload(server.port, burst=16, queue_bound=2))
        print(figures)
        assert figures["ok"] + figures["429"] == 16 and not figures["other"]
        assert figures["429"] >= 8 and figures["429_with_retry_after"] == figures["429"]
        # the queued ones completed, and a third when the first left the queue for the running
        # set before the burst filled it (a race the burst's timing decides: 2 or 3 on this VM)
        assert 2 <= figures["ok"] <= 3
        assert figures["slowest_429_s"] < 5  # refused at once, not after a wait
        books = server.wait_balanced()
        assert books["requests_accepted"] == figures["ok"]  # a 429 never entered the engine
    finally:
        assert server.stop() == 0


def test_sigterm_during_a_flood_drains_within_the_shutdown_timeout(tiny):
    grace = 2.0
    server = PyserveServer("--model", tiny, "--kv-cache-memory", "64MiB", "--max-num-seqs", "2",
                           "--shutdown-timeout", str(grace))
    try:
        figures = uvloop.run(stress.phase_shutdown(server, grace, streams=48))
        print(figures)
        assert figures["exit_code"] == 0
        assert figures["streams_cut"] > 0  # the flood outlasted the grace: the cut was tested
        assert figures["streams_failed"] == 0  # each cut stream ended with its abort and [DONE]
        assert figures["streams_ended_s"] < grace + 1.0
        assert figures["exit_s"] < grace + 5.0  # and the process is gone soon after
    finally:
        server.stop()


def test_new_connections_are_refused_once_shutting_down(tiny):
    server = PyserveServer("--model", tiny, "--kv-cache-memory", "64MiB", "--shutdown-timeout", "3")

    async def main():
        stream = asyncio.ensure_future(stress.sse_stream(server.port, stress.completion(0, 400)))
        await asyncio.sleep(0.3)
        server.proc.send_signal(15)
        refused, deadline = False, time.monotonic() + 10
        while not refused and time.monotonic() < deadline:  # the listening socket closes
            try:
                await request_json(server.port, post("/v1/completions", stress.completion(1, 2)))
                await asyncio.sleep(0.05)
            except OSError:
                refused = True
        assert refused, "new connections were still accepted 10 s after SIGTERM"
        return await stream
    try:
        result = uvloop.run(main())
        assert result.status == 200 and result.error == ""  # the running stream was let finish
    finally:
        server.stop()
