"""Raw HTTP for the compat tests: the exact JSON a server sends (which fields are present, and
which are null), which the openai SDK's objects blur."""

import http.client
import json


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
