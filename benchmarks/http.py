"""Cost of the HTTP layer: requests/s and p50/p99 latency of GET /health and of a 1-token
completion under 64 concurrent keep-alive connections, against a running server.

    python -m benchmarks.http --base-url http://127.0.0.1:8000 [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from urllib.parse import urlsplit


async def _read_response(reader: asyncio.StreamReader) -> int:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) != b"\r\n":
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def _load(host: str, port: int, request: bytes, connections: int, per_connection: int):
    latencies, failures = [], 0

    async def worker():
        nonlocal failures
        reader, writer = await asyncio.open_connection(host, port)
        for _ in range(per_connection):
            start = time.perf_counter()
            writer.write(request)
            if await _read_response(reader) != 200:
                failures += 1
            latencies.append(time.perf_counter() - start)
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "failures": failures, "rps": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--health-requests", type=int, default=100, help="per connection")
    parser.add_argument("--completion-requests", type=int, default=5, help="per connection")
    args = parser.parse_args()
    url = urlsplit(args.base_url)
    host, port = url.hostname, url.port or 80
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    completion = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    for name, request, n in (("GET /health", health, args.health_requests),
                             ("1-token completion", completion, args.completion_requests)):
        r = asyncio.run(_load(host, port, request, args.connections, n))
        print(f"{name:<20} {args.connections} connections: {r['requests']} requests, "
              f"{r['failures']} failed, {r['rps']:.0f} req/s, p50 {r['p50_ms']:.1f} ms, "
              f"p99 {r['p99_ms']:.1f} ms")


if __name__ == "__main__":
    main()
