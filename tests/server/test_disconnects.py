"""A client that goes away aborts its request, whatever state the request is in: waiting in the
queue, in its (chunked) prefill, mid-stream, or running for a non-streaming answer. Over real
sockets to a real server: the books (GET /debug/books) must show it aborted, its KV blocks
freed and nothing else disturbed, within a bound far above one step (against blow-ups only).

The server runs one sequence at a time (--max-num-seqs 1) with 32-token steps, so a request
queues behind another and a long prompt takes many steps to prefill."""

import json
import socket
import time

import pytest

from tests.e2e.server import ServerProcess, assert_books_balanced, fetch_books

FREED_WITHIN_S = 10.0  # one step is well under a second; this only catches a request left behind
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 120  # ~1,200 tokens: ~40 steps


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--enable-debug-endpoints", "--max-num-seqs", "1",
                        "--max-num-batched-tokens", "32")
    yield srv
    assert srv.stop() == 0


def _open(server, body: dict) -> socket.socket:
    payload = json.dumps({"temperature": 0, "ignore_eos": True, **body}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))
    return s


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before {marker!r}: {data!r}"
        data += chunk
    return data


def _wait_books(server, ok, what: str, timeout_s: float = FREED_WITHIN_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        books = fetch_books(server.url)["books"]
        if ok(books):
            return books
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s: {books}"
        time.sleep(0.01)


def _gone(s: socket.socket) -> float:
    """Closes the client's socket at once (RST, as a killed client); returns the time."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    return time.monotonic()


def _freed(server, aborted_before: int, running: int = 0) -> dict:
    """Waits for one more aborted request and the state of `running` requests only."""
    return _wait_books(server, lambda b: b["requests_aborted"] == aborted_before + 1
                       and b["num_waiting"] == 0 and b["num_running"] == running
                       and b["kv_manager_requests"] == running and b["streams_open"] == running,
                       "the request aborted and its state freed")


def test_a_client_gone_while_queued(server):
    aborted = fetch_books(server.url)["books"]["requests_aborted"]
    first = _open(server, {"prompt": "Hello", "max_tokens": 2000, "stream": True})
    _read_until(first, b"data: {")  # running: it holds the only sequence slot
    queued = _open(server, {"prompt": "Hi there", "max_tokens": 5, "stream": True})
    _read_until(queued, b"\r\n\r\n")  # admitted (the stream's head), waiting behind the first
    _wait_books(server, lambda b: b["num_waiting"] == 1, "the second request queued")
    t0 = _gone(queued)
    books = _freed(server, aborted, running=1)  # the first runs on, untouched
    print(f"queued: freed {1000 * (time.monotonic() - t0):.0f} ms after the close")
    assert books["requests_in_table"] == 1
    _gone(first)
    _freed(server, aborted + 1)
    assert_books_balanced(server.url)


def test_a_client_gone_during_prefill(server):
    aborted = fetch_books(server.url)["books"]["requests_aborted"]
    s = _open(server, {"prompt": LONG_PROMPT, "max_tokens": 5, "stream": True})
    head = _read_until(s, b"\r\n\r\n")
    _wait_books(server, lambda b: b["num_running"] == 1 and b["kv_blocks_referenced"] > 0,
                "the long prompt running")
    s.setblocking(False)
    try:
        early = s.recv(65536)
    except BlockingIOError:
        early = b""
    assert b"data: {" not in head + early, "the prompt finished its prefill before the test closed"
    t0 = _gone(s)
    books = _freed(server, aborted)
    print(f"prefill: freed {1000 * (time.monotonic() - t0):.0f} ms after the close")
    assert books["kv_blocks_referenced"] == 0
    assert_books_balanced(server.url)


def test_a_client_gone_mid_stream(server):
    aborted = fetch_books(server.url)["books"]["requests_aborted"]
    s = _open(server, {"prompt": "Count to a thousand:", "max_tokens": 2000, "stream": True})
    data = _read_until(s, b"data: {")
    while data.count(b"data: {") < 3:  # a few tokens streamed
        data += s.recv(65536)
    t0 = _gone(s)
    _freed(server, aborted)
    print(f"mid-stream: freed {1000 * (time.monotonic() - t0):.0f} ms after the close")
    assert_books_balanced(server.url)


def test_a_client_gone_waiting_for_a_non_streaming_answer(server):
    books = fetch_books(server.url)["books"]
    aborted, finished = books["requests_aborted"], books["requests_finished"]
    s = _open(server, {"prompt": "Count to a thousand:", "max_tokens": 2000})
    _wait_books(server, lambda b: b["num_running"] == 1, "the request running")
    time.sleep(0.3)  # a few decode steps in
    t0 = _gone(s)
    books = _freed(server, aborted)
    print(f"non-streaming: freed {1000 * (time.monotonic() - t0):.0f} ms after the close")
    assert books["requests_finished"] == finished  # aborted, not finished
    assert_books_balanced(server.url)

