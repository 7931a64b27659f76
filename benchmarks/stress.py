"""`python -m benchmarks.stress`: floods, disconnects and faults against servers it starts.

Phases, each printed as it ends (--json: one object at the end):
  faults      the main server runs with $PYSERVE_TEST_FAULT_STEP: the streams in that step
              must end with an error event, the books count them errored, /health stays 200
              and the next request completes (the engine recovers; engine/faults.py);
  streams     --streams SSE streams opened at --ramp per second (--slow-fraction of them
              slow readers with a tiny receive buffer), a short generation each, while
              /health is polled: peak streams held (client side: head in, end not yet read;
              each stream reads on only once all are held; server side: the books' open
              streams) and /health p50/p99;
  half-open   --half-open connections that send part of a request's headers and never finish
              (slowloris): each must be closed at --header-timeout, while /health and a few
              normal requests are timed;
  disconnects --disconnects streams, one at a time on the otherwise idle server, each closed
              by its client after its first event: the time from the close to the books
              showing it aborted with its KV blocks freed (polled on /debug/books);
  overload    a second server with --max-num-queued-requests: a burst beyond it gets 429 with
              Retry-After at once, the rest complete; none hangs;
  shutdown    SIGTERM to that server while streams run: it must exit within its
              --shutdown-timeout plus a second or so.
Both servers' books must balance (GET /debug/books) before they stop.
--quick: sizes a CI test runs in well under a minute."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import orjson
import uvloop

from benchmarks.raw_http import (HealthProbe, connect, get, percentiles, post, read_body,
                                 read_head, request_json, sse_stream)
from benchmarks.server_process import PyserveServer
from pyserve.server.fd_limit import raise_open_file_limit

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4,"]
FULL = dict(streams=2000, ramp=500.0, slow_fraction=0.1, half_open=1000, header_timeout=5.0,
            disconnects=50, overload_burst=64, max_tokens=8)
QUICK = dict(streams=150, ramp=400.0, slow_fraction=0.1, half_open=100, header_timeout=1.0,
             disconnects=8, overload_burst=24, max_tokens=4)
FAULT_STEP = 3
# a flood's last streams wait for all before them: on two shared cores 2,000 of them took
# over 300 s (the model's steps, not the server, set the pace), so a stream may take this long
STREAM_TIMEOUT_S = 1800.0
# how long the held streams wait for the last of the flood to arrive before reading on
HOLD_TIMEOUT_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model folder (default: pyserve's default model)")
    p.add_argument("--quick", action="store_true", help="CI sizes")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value),
                       help=f"(default {value}; --quick: {QUICK[name]})")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def completion(i: int, max_tokens: int, **extra) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


async def phase_faults(port: int, server: PyserveServer) -> dict:
    before = server.books()["books"]
    results = await asyncio.gather(*(sse_stream(port, completion(i, 8)) for i in range(4)))
    status, _, _ = await request_json(port, get("/health", keep_alive=False))
    after_status, _, answer = await request_json(port, post("/v1/completions", completion(0, 4)))
    books = server.wait_balanced()
    return {"fault_step": FAULT_STEP,
            "streams_with_error_event": sum(bool(r.error) and r.status == 200 for r in results),
            "streams_completed": sum(r.done and not r.error for r in results),
            "errored_in_books": books["requests_errored"] - before["requests_errored"],
            "health_after": status, "next_request": after_status,
            "next_request_finish": answer.get("choices", [{}])[0].get("finish_reason")}


async def poll_open_streams(server: PyserveServer, stop: asyncio.Event, peak: list) -> None:
    """The server's own count of open engine streams, polled: its peak goes in peak[0]."""
    while not stop.is_set():
        status, _, answer = await request_json(server.port, get("/debug/books", keep_alive=False))
        if status == 200:
            peak[0] = max(peak[0], answer["books"]["streams_open"])
        await asyncio.sleep(0.25)


async def phase_streams(port: int, server: PyserveServer, n: int, ramp: float,
                        slow_fraction: float, max_tokens: int) -> dict:
    held = {"now": 0, "peak": 0}
    all_held = asyncio.Event()

    async def until_all_held():
        # every stream is held open before any is read on: the peak is the whole flood
        # however fast the model answers (a stream that failed first leaves it to time out)
        try:
            await asyncio.wait_for(all_held.wait(), HOLD_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass

    def on_head():
        held["now"] += 1
        held["peak"] = max(held["peak"], held["now"])
        if held["peak"] == n:
            all_held.set()
        return until_all_held()

    async def one(i: int):
        await asyncio.sleep(i / ramp)
        slow = i % max(1, round(1 / slow_fraction)) == 0 if slow_fraction > 0 else False
        result = await sse_stream(port, completion(i, max_tokens), on_head=on_head,
                                  rcvbuf=2048 if slow else None, read_delay_s=0.05 if slow else 0.0,
                                  timeout_s=STREAM_TIMEOUT_S)
        if result.t_head:
            held["now"] -= 1
        return result

    stop, server_peak = asyncio.Event(), [0]
    probe = HealthProbe(port)
    background = [asyncio.ensure_future(probe.run(stop)),
                  asyncio.ensure_future(poll_open_streams(server, stop, server_peak))]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*background)
    errors = [r.error for r in results if r.error or not r.done]
    return {"streams": n, "peak_streams_held_client": held["peak"],
            "peak_streams_open_server": server_peak[0], "completed": n - len(errors),
            "failed": len(errors), "first_errors": errors[:3], "seconds": round(elapsed, 1),
            "health": probe.summary()}


async def phase_half_open(port: int, n: int, header_timeout: float) -> dict:
    """n slowloris connections; each should be closed by the server at the header timeout."""
    async def slowloris(i: int):
        await asyncio.sleep(i / 1000)  # 1,000 a second: the flood itself is not the test
        try:
            reader, writer = await connect(port)
        except OSError as exc:
            return None, f"connect: {exc}"
        writer.write(b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Slow: ")  # never finished
        t0 = time.perf_counter()
        try:
            data = await asyncio.wait_for(reader.read(), header_timeout + 30)
            return time.perf_counter() - t0, data[:12].decode("latin-1")
        except (OSError, asyncio.TimeoutError) as exc:
            return None, type(exc).__name__
        finally:
            writer.close()

    async def normal_requests(stop: asyncio.Event, latencies: list):
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            status, _, _ = await request_json(port, post("/v1/completions", completion(i, 2)))
            if status == 200:
                latencies.append((time.perf_counter() - t0) * 1000)
            i += 1
            await asyncio.sleep(0.1)

    baseline = []  # the same normal requests before the flood, to compare against
    for i in range(5):
        t0 = time.perf_counter()
        await request_json(port, post("/v1/completions", completion(i, 2)))
        baseline.append((time.perf_counter() - t0) * 1000)
    stop, normal = asyncio.Event(), []
    probe = HealthProbe(port)
    background = [asyncio.ensure_future(probe.run(stop)),
                  asyncio.ensure_future(normal_requests(stop, normal))]
    closes = await asyncio.gather(*(slowloris(i) for i in range(n)))
    stop.set()
    await asyncio.gather(*background)
    waits = [t for t, _ in closes if t is not None]
    at_timeout = [t for t in waits if header_timeout * 0.9 <= t <= header_timeout + 3.0]
    return {"half_open": n, "closed_by_server_at_header_timeout": len(at_timeout),
            "header_timeout_s": header_timeout, **percentiles(waits, "s"),
            "not_closed": [why for t, why in closes if t is None][:3],
            "health": probe.summary(), "normal_requests": {"count": len(normal),
                                                           **percentiles(normal, "ms")},
            "normal_requests_before": percentiles(baseline, "ms")}


async def phase_disconnects(port: int, trials: int) -> dict:
    """Close-to-freed times, one disconnect at a time on an idle server."""
    books_reader, books_writer = await connect(port)

    async def books() -> dict:
        books_writer.write(get("/debug/books"))
        _, headers = await read_head(books_reader)
        return orjson.loads(await read_body(books_reader, headers))["books"]

    times = []
    try:
        for i in range(trials):
            aborted = (await books())["requests_aborted"]
            reader, writer = await connect(port)
            writer.write(post("/v1/completions", completion(i, 400, stream=True)))
            await read_head(reader)
            await reader.readuntil(b"data: {")  # running, its first token out
            writer.transport.abort()  # gone at once, as a killed client
            t0 = time.perf_counter()
            while True:
                b = await books()
                if (b["requests_aborted"] > aborted and b["kv_manager_requests"] == 0
                        and b["streams_open"] == 0):
                    break
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError(f"a disconnected request was not freed in 30 s: {b}")
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        books_writer.close()
    return {"disconnects": trials, **percentiles(times, "ms")}


async def phase_overload(port: int, burst: int, queue_bound: int) -> dict:
    t0 = time.perf_counter()

    async def one(i: int):
        status, headers, _ = await request_json(port, post("/v1/completions", completion(i, 16)),
                                                timeout_s=120)
        return status, headers.get("retry-after"), time.perf_counter() - t0

    answers = await asyncio.gather(*(one(i) for i in range(burst)))
    refused = [a for a in answers if a[0] == 429]
    return {"burst": burst, "max_num_queued_requests": queue_bound,
            "ok": sum(a[0] == 200 for a in answers), "429": len(refused),
            "429_with_retry_after": sum(a[1] is not None for a in refused),
            "other": sorted({a[0] for a in answers} - {200, 429}),
            "slowest_429_s": round(max((a[2] for a in refused), default=0.0), 3)}


async def phase_shutdown(server: PyserveServer, grace_s: float, streams: int) -> dict:
    tasks = [asyncio.ensure_future(sse_stream(server.port, completion(i, 400)))
             for i in range(streams)]
    await asyncio.sleep(1.0)
    t0 = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    results = await asyncio.gather(*tasks)
    streams_ended_s = time.perf_counter() - t0
    while server.proc.poll() is None and time.perf_counter() - t0 < grace_s + 30:
        await asyncio.sleep(0.02)
    return {"grace_s": grace_s, "streams": streams, "streams_ended_s": round(streams_ended_s, 2),
            "exit_s": round(time.perf_counter() - t0, 2), "exit_code": server.proc.poll(),
            "streams_refused_429": sum(r.status == 429 for r in results),
            "streams_cut": sum(r.status == 200 and r.finish_reason != "length" for r in results),
            "streams_failed": sum(r.status != 429 and (bool(r.error) or not r.done)
                                  for r in results)}


def say(name: str, figures: dict, as_json: bool) -> None:
    if not as_json:
        print(f"{name:12s} {json.dumps(figures)}", flush=True)


async def run(args, sizes: dict) -> dict:
    model = ["--model", args.model] if args.model else []
    report = {}
    main = PyserveServer(*model, "--header-timeout", str(sizes["header_timeout"]),
                         env={"PYSERVE_TEST_FAULT_STEP": str(FAULT_STEP)})
    try:
        for name, phase in (
                ("faults", lambda: phase_faults(main.port, main)),
                ("streams", lambda: phase_streams(main.port, main, sizes["streams"], sizes["ramp"],
                                                  sizes["slow_fraction"], sizes["max_tokens"])),
                ("half-open", lambda: phase_half_open(main.port, sizes["half_open"],
                                                      sizes["header_timeout"])),
                ("disconnects", lambda: phase_disconnects(main.port, sizes["disconnects"]))):
            report[name] = await phase()
            say(name, report[name], args.json)
        report["books_main"] = main.wait_balanced()
    finally:
        main.stop()
    queue_bound, grace = 4, 2.0
    small = PyserveServer(*model, "--max-num-queued-requests", str(queue_bound),
                          "--max-num-seqs", "2", "--shutdown-timeout", str(grace))
    try:
        report["overload"] = await phase_overload(small.port, sizes["overload_burst"], queue_bound)
        say("overload", report["overload"], args.json)
        report["books_overload"] = small.wait_balanced()
        report["shutdown"] = await phase_shutdown(small, grace, 48)
        say("shutdown", report["shutdown"], args.json)
    finally:
        small.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = {name: getattr(args, name) if getattr(args, name) is not None else
             (QUICK if args.quick else FULL)[name] for name in FULL}
    raise_open_file_limit()  # this client holds as many sockets as the server
    report = uvloop.run(run(args, sizes))
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
