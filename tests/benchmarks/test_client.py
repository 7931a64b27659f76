"""benchmarks/client.py: the SSE decoder, and the request functions against a scripted
aiohttp server on a loopback port."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from benchmarks.client import RequestInput, SSEDecoder, request_chat, request_completions


def test_sse_decoder_joins_split_events_and_skips_comments():
    d = SSEDecoder()
    assert d.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['{"a": 1}']
    assert d.feed(b': 2}\r\n\r\n: ping\n\ndata: [DONE]\n\n') == ['{"b": 2}', "[DONE]"]
    # a multi-byte character split between reads is decoded once whole
    snow = "data: \u2603\n\n".encode()
    assert d.feed(snow[:8]) == [] and d.feed(snow[8:]) == ["\u2603"]


def _chunk(text=None, usage=None, chat=False):
    choice = {"index": 0, ("delta" if chat else "text"): {"content": text} if chat else text}
    event = {"choices": [] if text is None else [choice]}
    if usage:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _serve(script, coro_fn):
    """Runs coro_fn(url) against a server that answers every POST with script(request)."""
    async def handler(request):
        return await script(request)

    app = web.Application()
    app.router.add_post("/v1/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession() as session:
            return await coro_fn(f"http://127.0.0.1:{port}", session)
    finally:
        await runner.cleanup()


def _streamer(events, gap_s=0.0, seen=None):
    async def script(request):
        if seen is not None:
            seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await resp.write(event)
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp
    return script


def _input(url, path, **kw):
    return RequestInput(prompt="hi", prompt_len=3, output_len=4, model="m",
                        api_url=url + path, **kw)


def test_completions_are_timed_per_chunk_and_usage_wins():
    seen = []
    events = [_chunk("a"), _chunk("b"), _chunk("c"),
              _chunk(usage={"prompt_tokens": 7, "completion_tokens": 3})]
    r = asyncio.run(_serve(_streamer(events, 0.05, seen), lambda url, s: request_completions(
        _input(url, "/v1/completions", ignore_eos=True, extra_body={"temperature": 0}), s)))
    assert r.success and r.generated_text == "abc" and r.error == ""
    assert (r.output_tokens, r.prompt_len) == (3, 7)
    assert len(r.itl) == 2 and all(gap >= 0.04 for gap in r.itl)
    # the latency ends at the last token, so latency = ttft + the gaps
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    body = seen[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0


def test_chat_counts_the_role_chunk_as_first_as_vllm_does():
    seen = []
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    events = [role, _chunk("x", chat=True), _chunk("y", chat=True)]
    r = asyncio.run(_serve(_streamer(events, 0.0, seen), lambda url, s: request_chat(
        _input(url, "/v1/chat/completions"), s)))
    assert r.success and r.generated_text == "xy" and len(r.itl) == 2
    assert r.output_tokens == 0  # no usage sent: metrics.py re-counts the text
    assert seen[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert seen[0]["max_completion_tokens"] == 4 and "ignore_eos" not in seen[0]


def test_failures_say_why():
    async def not_found(request):
        return web.json_response({"error": {"message": "no such model"}}, status=404)

    r = asyncio.run(_serve(not_found, lambda url, s: request_completions(
        _input(url, "/v1/completions"), s)))
    assert not r.success and "404" in r.error and "no such model" in r.error

    broken = [_chunk("a"), b'data: {"error": {"message": "generation failed"}}\n\n']
    r = asyncio.run(_serve(_streamer(broken), lambda url, s: request_completions(
        _input(url, "/v1/completions"), s)))
    assert not r.success and "generation failed" in r.error

    r = asyncio.run(_serve(_streamer([]), lambda url, s: request_completions(
        _input(url, "/v1/completions"), s)))
    assert not r.success and "without a single choice" in r.error

    async def refused(url, session):
        return await request_completions(_input("http://127.0.0.1:9", "/v1/completions"), session)
    r = asyncio.run(_serve(not_found, refused))
    assert not r.success and "ClientConnectorError" in r.error


def test_usage_in_the_same_event_as_the_last_choice_is_read():
    # llama-server sends its usage beside the final choice, not in an event of its own
    last = b"data: " + json.dumps({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}],
                                   "usage": {"prompt_tokens": 5, "completion_tokens": 9}}).encode() + b"\n\n"
    r = asyncio.run(_serve(_streamer([_chunk("a"), _chunk("b"), last]), lambda url, s: request_completions(
        _input(url, "/v1/completions"), s)))
    assert r.success and r.generated_text == "abc"
    assert (r.output_tokens, r.prompt_len) == (9, 5)


async def _raw_server(behaviour):
    """A loopback HTTP/1.1 server: behaviour(connection number, request number on it) says
    "answer" (a whole SSE body, the connection kept alive) or "close" (read it, answer nothing)."""
    body = _chunk("a") + b"data: [DONE]\n\n"
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    connections = [0]

    async def on_connection(reader, writer):
        connections[0] += 1
        number, served = connections[0], 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                served += 1
                if behaviour(number, served) == "close":
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_request_on_a_kept_alive_connection_closed_under_it_goes_again_and_is_counted():
    from benchmarks.client import connection_reuse_trace

    async def run(behaviour):
        server, port = await _raw_server(behaviour)
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                             trace_configs=[connection_reuse_trace()]) as session:
                url = f"http://127.0.0.1:{port}"
                return [await request_completions(_input(url, "/v1/completions"), session) for _ in range(2)]
        finally:
            server.close()

    # the first connection's second request is dropped: it went on a pooled connection
    first, second = asyncio.run(run(lambda conn, n: "close" if (conn, n) == (1, 2) else "answer"))
    assert first.success and first.resends == 0
    assert second.success and second.resends == 1 and second.generated_text == "a"
    # a new connection that fails is the server's failure: not sent again
    first, second = asyncio.run(run(lambda conn, n: "close" if conn == 1 else "answer"))
    assert not first.success and first.resends == 0 and "Disconnected" in first.error
    assert second.success


def test_only_requests_that_never_arrived_are_sent_again():
    from benchmarks.client import never_arrived

    unwritten = aiohttp.ClientOSError(None, "Can not write request body for http://x/v1/completions")
    assert never_arrived(unwritten, reused=False) and never_arrived(unwritten, reused=True)
    closed = aiohttp.ServerDisconnectedError()
    assert never_arrived(closed, reused=True) and not never_arrived(closed, reused=False)
    reset = aiohttp.ClientOSError(104, "Connection reset by peer")
    assert not never_arrived(reset, reused=False) and never_arrived(reset, reused=True)
