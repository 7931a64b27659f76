"""The server's operational behaviour end to end: CORS, a bounded queue, limits on the real
server, pipelining, 64 concurrent streams, per-request chat templates, and shutdown."""

import asyncio
import json
import signal
import socket
import time

import openai
import pytest

from .server import ServerProcess
from .test_server import MODEL, http_json, raw

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--allowed-origins", "https://ok.example", "--max-header-bytes", "4096",
                        "--max-request-body-bytes", "100000", "--max-num-queued-requests", "200",
                        "--trust-request-chat-template")
    yield srv
    assert srv.stop() == 0


def test_cors_preflight_and_simple_requests(server):
    status, body, headers = http_json(server, "OPTIONS", "/v1/completions", headers={
        "Origin": "https://ok.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == "https://ok.example"
    assert "POST" in headers["access-control-allow-methods"]
    assert "content-type" in headers["access-control-allow-headers"]
    status, _, headers = http_json(server, "OPTIONS", "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 400
    status, _, headers = http_json(server, "GET", "/v1/models", headers={"Origin": "https://ok.example"})
    assert status == 200 and headers["access-control-allow-origin"] == "https://ok.example"
    status, _, headers = http_json(server, "GET", "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_limits_and_pipelining_on_the_real_server(server):
    status, body = raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 5000 + b"\r\n\r\n")
    assert status == 431 and body["error"]["code"] == 431
    status, body = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n")
    assert status == 413
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        payload = json.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
        chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(payload), payload)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked +
                  b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = b""
        deadline = time.monotonic() + 30
        while reply.count(b"HTTP/1.1 200") < 3 and time.monotonic() < deadline:
            reply += s.recv(65536)
    assert reply.count(b"HTTP/1.1 200") == 3
    assert reply.index(b'"object":"list"') < reply.index(b'"text_completion"') < reply.rindex(b"{}")


def test_queue_bound_answers_429(default_model_dir):
    import threading

    srv = ServerProcess("--max-num-queued-requests", "1", "--max-num-seqs", "1")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        done = threading.Event()

        def long_request():
            # far longer than the test: each stream is closed (aborting it) once done is set
            stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1000,
                                               temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            for _ in stream:
                if done.is_set():
                    break
            stream.close()

        running = threading.Thread(target=long_request)
        running.start()
        time.sleep(1.0)  # running now: the queue is empty
        queued = threading.Thread(target=long_request)
        queued.start()
        time.sleep(0.5)  # waits behind it (max-num-seqs 1): the queue is full
        status, body, headers = http_json(srv, "POST", "/v1/completions",
                                          {"prompt": "Hi", "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1"
        assert json.loads(body)["error"]["code"] == 429
        done.set()
        running.join()
        queued.join()
        status, _, _ = http_json(srv, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 200
    finally:
        assert srv.stop() == 0


def test_sixty_four_concurrent_streams(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompts = [f"Item {i}: the colour of the sky is" for i in range(64)]

    async def stream(p):
        text = ""
        async for chunk in await client.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def whole(p):
        return (await client.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                                temperature=0)).choices[0].text

    async def main():
        streamed = await asyncio.gather(*(stream(p) for p in prompts))
        expected = await asyncio.gather(*(whole(p) for p in prompts))
        return streamed, expected

    streamed, expected = asyncio.run(main())
    assert streamed == expected and all(streamed)


def test_per_request_chat_template(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    template = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"
    status, body, _ = http_json(server, "POST", "/tokenize", {
        "messages": [{"role": "user", "content": "Hi"}], "chat_template": template})
    ids = json.loads(body)["tokens"]
    status, body, _ = http_json(server, "POST", "/detokenize", {"tokens": ids})
    assert json.loads(body)["prompt"] == "Q: Hi\nA:"
    out = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"chat_template": template})
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("sig,grace", [(signal.SIGTERM, "0"), (signal.SIGINT, "30")])
def test_shutdown_during_a_stream_ends_it_cleanly(default_model_dir, sig, grace):
    srv = ServerProcess("--shutdown-timeout", grace)
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        body = json.dumps({"prompt": "Count:", "max_tokens": 4000, "stream": True,
                           "ignore_eos": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
                  % (len(body), body))
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += s.recv(65536)
        srv.proc.send_signal(sig)
        s.settimeout(20)
        while not seen.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            seen += chunk
    assert b'"finish_reason":"abort"' in seen and b"data: [DONE]" in seen
    assert srv.proc.wait(30) == 0


def test_health_says_loading_until_ready(default_model_dir):
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from .server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyserve", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, during_load = [], (None, b"{}")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not seen or seen[-1][0] != 200):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    seen.append((r.status, json.loads(r.read())))
                    continue
            except urllib.error.HTTPError as e:
                seen.append((e.code, json.loads(e.read())))
                if len(seen) == 1:  # still loading: a completion is refused with 503
                    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                                 data=b'{"prompt": "Hi"}', method="POST")
                    try:
                        urllib.request.urlopen(req, timeout=5)
                    except urllib.error.HTTPError as err:
                        during_load = (err.code, err.read())
            except OSError:
                pass
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert seen[0] == (503, {"status": "loading"})
    assert during_load[0] == 503 and json.loads(during_load[1])["error"]["code"] == 503
    assert seen[-1] == (200, {"status": "ok"})
