"""Raw HTTP for the compat tests: the exact JSON a server sends (which fields are present, and
which are null), which the openai SDK's objects blur."""

import http.client
import json
import socket


def post(server, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    """(status, the JSON answer) of a POST; raw: the body's exact bytes (numbers JSON keeps
    that Python's json would not write)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, raw if raw is not None else json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def stream(server, path: str, body) -> list[dict]:
    """The data events of a streamed answer, parsed, up to [DONE] (which must come)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        text = response.read().decode()
    finally:
        conn.close()
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1:]
    return [json.loads(e) for e in events[:-1]]


def open_unread_stream(server, body, key: str | None = None) -> socket.socket:
    """A POST /v1/completions whose client reads nothing yet: a small receive buffer, so the
    server cannot finish writing an answer larger than the socket buffers until it is read."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps(body).encode()
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"%scontent-length: %d\r\n\r\n%s" % (auth, len(data), data))
    return sock


def read_chunked_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until its chunked answer's last chunk."""
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(1 << 16)
        assert chunk, "the server closed the stream early"
        received += chunk
    return received
