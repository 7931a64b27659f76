"""`python -m benchmarks.soak --minutes M`: mixed traffic against a server it starts, watching
the server for slow leaks.

Traffic (--concurrency clients, each sending its next request as its last ends): streaming
and not, completions and chat, n=2, logprobs, a prefix-sharing slice (a long shared preamble
with a varying tail), 10% of clients that disconnect after their first event, 1% invalid
requests (each must be refused with a 4xx). Every --interval seconds the server's RssAnon
(anonymous resident memory, from /proc/PID/status: what a leak grows), open file descriptors,
threads and event-loop lag (a /health round trip) are recorded against the requests done.
At the end: the memory slope in KiB per 1,000 requests, a least-squares fit over the samples
after the first quarter (start-up caches and allocator arenas settle first), and the books
must balance (GET /debug/books); the exit status is 1 if they do not or if any request got an
answer its kind does not allow.

Those samples move with what is in flight (a batch's tensors, open streams) and with where
the allocator happens to be between two of the server's malloc_trim calls (every 10 s), by
several MiB either way, so a fit over them cannot resolve a slope of a few KiB per 1,000
requests. Every --checkpoint seconds the traffic therefore pauses: the clients finish what
they sent, the server goes idle (its books show nothing running or waiting), one trim
interval passes so that the server trims while idle, and RssAnon is read then. The slope over
those quiescent checkpoints (those after the first quarter of them, and never the first) is
what a leak grows: the "quiescent_slope_kib_per_1000_requests" of the report.

Part of that is no leak: the KV pool is one allocation made at start-up, whose pages become
resident as blocks are first written, and the pool hands out a never-used block only when no
freed one is left, so its resident share grows to the most blocks held at once and then stops
(it can never pass the pool's size). Each checkpoint therefore also reads the pool's resident
KiB and the blocks ever handed out (the books' kv_pool_resident_bytes, from mincore, and
kv_blocks_touched); "quiescent_slope_excluding_kv_pool_kib_per_1000_requests" is the slope of
RssAnon less that resident pool, everything else the process holds."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import uvloop

from benchmarks.raw_http import connect, get, percentiles, post, read_head, request_json, sse_stream
from benchmarks.server_process import PyserveServer

from pyserve.server.malloc_trim import TRIM_INTERVAL_S

# a checkpoint's idle wait: the server's trim interval and a second, so that one trim falls
# inside it
TRIM_WAIT_S = TRIM_INTERVAL_S + 1.0

PREAMBLE = ("You are a careful assistant. Answer briefly and exactly. The rules: be precise, "
            "cite nothing, use plain words, never repeat the question. ") * 3
TAILS = ["What is two plus two?", "Name a colour.", "Say hello.", "Count to three.",
         "What day follows Monday?", "Spell cat."]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--model", help="model folder (default: pyserve's default model)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--checkpoint", type=float, default=120.0,
                   help="seconds of traffic between quiescent checkpoints (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    return p


def proc_figures(pid: int) -> dict:
    """RssAnon (KiB), threads and open descriptors of a live process."""
    figures = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == "RssAnon":
                figures["rss_anon_kib"] = int(value.split()[0])
            elif name == "Threads":
                figures["threads"] = int(value)
    figures["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return figures


def slope_per_1000(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs, times 1,000; None with too few distinct xs."""
    n = len(xs)
    if n < 3 or max(xs) == min(xs):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def pick(rng: random.Random) -> tuple[str, dict]:
    """A request kind and its body."""
    r = rng.random()
    tail = rng.choice(TAILS)
    if r < 0.01:
        return "invalid", rng.choice([{"prompt": "x", "max_tokens": -3},
                                      {"max_tokens": 4}, {"prompt": "x", "n": 0}])
    if r < 0.11:
        return "disconnect", {"prompt": tail, "max_tokens": 64, "ignore_eos": True}
    body = {"max_tokens": rng.randint(2, 24), "temperature": rng.choice([0.0, 0.8]), "seed": 1}
    if r < 0.31:
        body["prompt"] = PREAMBLE + tail  # the prefix-sharing slice
    elif r < 0.45:
        return "chat", {**body, "messages": [{"role": "user", "content": tail}],
                        "stream": rng.random() < 0.5}
    else:
        body["prompt"] = tail
    if r > 0.9:
        body["n"] = 2
    elif r > 0.8:
        body["logprobs"] = 2
    body["stream"] = rng.random() < 0.5
    return "completion", body


async def one_request(port: int, kind: str, body: dict) -> str:
    """The request's outcome: ok, disconnected, refused (a 4xx for an invalid one) or a
    description of what went wrong."""
    if kind == "disconnect":
        reader, writer = await connect(port)
        writer.write(post("/v1/completions", {**body, "stream": True}))
        await read_head(reader)
        await reader.readuntil(b"data: {")
        writer.transport.abort()
        return "disconnected"
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if body.get("stream"):
        result = await sse_stream(port, body, path=path)
        if result.done and not result.error:
            return "ok"
        return f"{kind} stream: {result.error or 'no [DONE]'}"
    status, _, answer = await request_json(port, post(path, body))
    if kind == "invalid":
        return "refused" if 400 <= status < 500 else f"invalid request answered {status}"
    return "ok" if status == 200 and answer.get("choices") else f"{kind}: HTTP {status}"


async def soak(port: int, pid: int, minutes: float, concurrency: int, interval: float,
               seed: int, checkpoint_s: float = 0.0, books=None) -> dict:
    """books: a callable giving GET /debug/books (for the checkpoints' idle test)."""
    deadline = time.monotonic() + 60 * minutes
    outcomes: dict[str, int] = {}
    samples, checkpoints = [], []
    flowing = asyncio.Event()  # cleared while a checkpoint holds the traffic back
    flowing.set()
    in_flight = [0]

    async def client(i: int):
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            await flowing.wait()
            kind, body = pick(rng)
            in_flight[0] += 1
            try:
                outcome = await one_request(port, kind, body)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                outcome = f"{kind}: {type(exc).__name__}"
            finally:
                in_flight[0] -= 1
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def quiesce() -> dict:
        """Holds the clients back until the server is idle and has trimmed; -> its RssAnon,
        its KV pool's resident KiB and the blocks ever handed out."""
        flowing.clear()
        while in_flight[0]:
            await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        for _ in range(200):  # disconnected clients' requests abort within a step
            state = (await loop.run_in_executor(None, books))["books"]
            if not state["num_running"] and not state["num_waiting"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(TRIM_WAIT_S)  # the server's malloc_trim runs once meanwhile
        figures = proc_figures(pid)
        pool = (await loop.run_in_executor(None, books))["books"]
        flowing.set()
        resident = pool["kv_pool_resident_bytes"]
        return {"rss_anon_kib": figures["rss_anon_kib"],
                "kv_pool_resident_kib": None if resident is None else resident // 1024,
                "kv_blocks_touched": pool["kv_blocks_touched"]}

    async def checkpointer():
        t0 = time.monotonic()
        while time.monotonic() + checkpoint_s < deadline:
            await asyncio.sleep(checkpoint_s)
            figures = await quiesce()
            checkpoints.append({"t_s": round(time.monotonic() - t0, 1),
                                "requests": sum(outcomes.values()), **figures})

    async def sampler():
        t0 = time.monotonic()
        while True:
            start = time.perf_counter()  # a fresh connection: keep-alive would time out between
            status, _, _ = await request_json(port, get("/health", keep_alive=False))
            lag_ms = (time.perf_counter() - start) * 1000
            samples.append({"t_s": round(time.monotonic() - t0, 1), "health_status": status,
                            "requests": sum(outcomes.values()), "health_ms": round(lag_ms, 2),
                            **proc_figures(pid)})
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(interval)

    watch = asyncio.ensure_future(sampler())
    pauses = asyncio.ensure_future(checkpointer()) if checkpoint_s > 0 and books else None
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    await watch
    if pauses is not None:
        await pauses
    settled = samples[len(samples) // 4:]
    # as for the samples, the first quarter (at least the first checkpoint) is start-up's
    # settling: caches and arenas filling over the first few thousand requests
    quiet = checkpoints[max(1, len(checkpoints) // 4):]
    return {"minutes": minutes, "requests": sum(outcomes.values()), "outcomes": outcomes,
            "rss_anon_slope_kib_per_1000_requests": _round(slope_per_1000(
                [s["requests"] for s in settled], [s["rss_anon_kib"] for s in settled])),
            "quiescent_slope_kib_per_1000_requests": _round(slope_per_1000(
                [c["requests"] for c in quiet], [c["rss_anon_kib"] for c in quiet])),
            "quiescent_slope_excluding_kv_pool_kib_per_1000_requests": _round(slope_per_1000(
                [c["requests"] for c in quiet],
                [c["rss_anon_kib"] - (c["kv_pool_resident_kib"] or 0) for c in quiet])),
            "checkpoints": checkpoints,
            "rss_anon_kib": {"first": samples[0]["rss_anon_kib"],
                             "last": samples[-1]["rss_anon_kib"]},
            "fds": {"first": samples[0]["fds"], "max": max(s["fds"] for s in samples),
                    "last": samples[-1]["fds"]},
            "threads": {"first": samples[0]["threads"], "max": max(s["threads"] for s in samples)},
            "health": percentiles([s["health_ms"] for s in samples], "ms"), "samples": samples}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def unexpected(outcomes: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in outcomes.items() if k not in ("ok", "disconnected", "refused")}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    server = PyserveServer(*(["--model", args.model] if args.model else []))
    try:
        report = uvloop.run(soak(server.port, server.pid, args.minutes, args.concurrency,
                                 args.interval, args.seed, args.checkpoint, server.books))
        try:
            report["books"] = server.wait_balanced()
            report["books_balanced"] = True
        except AssertionError as exc:
            report["books_balanced"], report["books_problem"] = False, str(exc)
    finally:
        server.stop()
    report["unexpected"] = unexpected(report["outcomes"])
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            if key != "samples":
                print(f"{key}: {json.dumps(value)}")
    return 0 if report["books_balanced"] and not report["unexpected"] else 1


if __name__ == "__main__":
    sys.exit(main())
