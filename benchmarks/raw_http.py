"""Raw asyncio HTTP/1.1 clients for floods: thousands of connections from one process cost
little more than their sockets (no client library in the way), a slow reader can shrink its
receive buffer, and a half-open connection is just bytes never finished."""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from dataclasses import dataclass, field

import orjson


def post(path: str, body: dict, keep_alive: bool = False) -> bytes:
    payload = orjson.dumps(body)
    return (b"POST %b HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%b\r\n%b" % (path.encode(), len(payload),
                                                 b"" if keep_alive else b"Connection: close\r\n",
                                                 payload))


def get(path: str, keep_alive: bool = True) -> bytes:
    return b"GET %b HTTP/1.1\r\nHost: bench\r\n%b\r\n" % (
        path.encode(), b"" if keep_alive else b"Connection: close\r\n")


async def connect(port: int, rcvbuf: int | None = None):
    """(reader, writer) to 127.0.0.1:port; rcvbuf: a receive buffer this small (slow readers)."""
    if rcvbuf is None:
        return await asyncio.open_connection("127.0.0.1", port)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        out = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            out += await reader.readexactly(size + 2)
            if size == 0:
                return bytes(out)
            del out[-2:]
    return await reader.read()


async def request_json(port: int, raw: bytes, timeout_s: float = 60.0) -> tuple[int, dict, dict]:
    """One request on its own connection: (status, headers, JSON body)."""
    reader, writer = await connect(port)
    try:
        writer.write(raw)
        status, headers = await asyncio.wait_for(read_head(reader), timeout_s)
        body = await asyncio.wait_for(read_body(reader, headers), timeout_s)
        return status, headers, orjson.loads(body) if body.strip() else {}
    finally:
        writer.close()


@dataclass
class StreamResult:
    status: int = 0
    events: int = 0  # data: events with a choice
    done: bool = False  # [DONE] arrived
    error: str = ""  # an error event, or what broke
    finish_reason: str | None = None  # the last one an event carried ("abort": cut short)
    t_head: float = 0.0  # perf_counter when the response head arrived
    t_end: float = 0.0


async def sse_stream(port: int, body: dict, rcvbuf: int | None = None, read_delay_s: float = 0.0,
                     timeout_s: float = 300.0, on_head=None,
                     path: str = "/v1/completions") -> StreamResult:
    """A streamed completion read to its end. read_delay_s: a slow reader sleeps this long
    between small reads. on_head(): called when the head arrives (the stream is held); if it
    returns an awaitable, the body is read once that is done."""
    result = StreamResult()
    reader, writer = await connect(port, rcvbuf)
    try:
        writer.write(post(path, {**body, "stream": True}))
        result.status, headers = await asyncio.wait_for(read_head(reader), timeout_s)
        result.t_head = time.perf_counter()
        held = on_head() if on_head is not None else None
        if held is not None:
            await held
        if result.status != 200:
            result.error = f"HTTP {result.status}"
            return result
        data = bytearray()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = await asyncio.wait_for(reader.read(256 if read_delay_s else 65536), timeout_s)
            if not chunk:
                break
            data += chunk
            if read_delay_s:
                await asyncio.sleep(read_delay_s)
        for line in bytes(data).split(b"\n"):
            if line.startswith(b"data: [DONE]"):
                result.done = True
            elif line.startswith(b"data: {"):
                if b'"error"' in line[:20]:
                    result.error = orjson.loads(line[6:])["error"]["message"]
                else:
                    result.events += 1
                    for choice in orjson.loads(line[6:]).get("choices", ()):
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    finally:
        result.t_end = time.perf_counter()
        writer.close()
    return result


@dataclass
class HealthProbe:
    """GET /health on one keep-alive connection every interval_s: the event loop's lag as a
    client sees it."""
    port: int
    interval_s: float = 0.02
    latencies_ms: list[float] = field(default_factory=list)
    failures: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        reader, writer = await connect(self.port)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    writer.write(get("/health"))
                    status, headers = await asyncio.wait_for(read_head(reader), 10)
                    await read_body(reader, headers)
                    if status != 200:
                        self.failures += 1
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                    self.failures += 1
                    writer.close()
                    reader, writer = await connect(self.port)
                    continue
                self.latencies_ms.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(self.interval_s)
        finally:
            writer.close()

    def summary(self) -> dict:
        return {"count": len(self.latencies_ms), "failures": self.failures,
                **percentiles(self.latencies_ms, "ms")}


def percentiles(values: list[float], unit: str) -> dict:
    if not values:
        return {f"p50_{unit}": None, f"p99_{unit}": None, f"max_{unit}": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {f"p50_{unit}": round(statistics.median(ordered), 2), f"p99_{unit}": round(p99, 2),
            f"max_{unit}": round(ordered[-1], 2)}
