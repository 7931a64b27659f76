"""Grammar compiles are bounded as a whole (issue 68, item 2), over a real socket to a real
server on the tiny model: a spec too big to compile is refused before anything runs, big
compiles run in a worker process of their own, at most a few at a time, and are killed when
their requests go away, so a one-property schema still compiles at once while they run.

Before the fix a choice of 100,000 strings compiled for a minute (the request got its 400
after 10 s, the compile went on), and two slow schemas held both compile threads, so every
later grammar, a one-property schema too, was a 400 "did not compile within 10 s"."""

import json
import socket
import time

from tests.e2e.server import child_pids

from .hostile import MODEL, accepted, post, refused
from .hostile import server  # noqa: F401  (the module's server)

# a one-property schema compiles in milliseconds, a refusal takes the time to read its body:
# slack for a loaded CI machine (before the fix both were 400s after 10 s)
SMALL_WITHIN_S = 5.0
REFUSED_WITHIN_S = 5.0
KILLED_WITHIN_S = 5.0  # an abandoned compile's process is killed as its last request leaves


def _completion(constraint: dict) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **constraint}


def _optional_properties(n: int, tag: str) -> dict:
    """A short schema that compiles slowly: xgrammar's time grows with the square of the
    optional properties (600 of them, 17 KB: half a minute on the tiny model's vocabulary)."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(n)}}


def _send_and_hold(srv, body: dict) -> socket.socket:
    """A request sent and left waiting: the server works on it until the socket closes."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def test_specs_too_big_to_compile_are_refused_before_compiling(server):
    choices = [f"choice number {i}" for i in range(100_000)]
    refused(server, "/v1/completions", _completion({"structured_outputs": {"choice": choices}}),
            "structured_outputs", "100,000 choices", "at most 1,000", within=REFUSED_WITHIN_S)
    refused(server, "/v1/completions", _completion({"guided_choice": choices}), "guided_choice",
            "choices", within=REFUSED_WITHIN_S)
    refused(server, "/v1/completions", _completion({"guided_regex": "a" * 70_000}), "guided_regex",
            "characters", within=REFUSED_WITHIN_S)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 9}
                                               for i in range(3_000)}}
    refused(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
        "response_format", "characters", within=REFUSED_WITHIN_S)
    accepted(server, "/v1/completions", _completion({"guided_choice": choices[:1_000]}))


def test_a_small_schema_compiles_at_once_while_big_ones_run(server):
    # a big spec that compiles quickly: the worker process is started and ready
    accepted(server, "/v1/completions", _completion({"guided_json": _optional_properties(40, "w")}))
    hostile = [_send_and_hold(server, _completion({"guided_json": _optional_properties(600, tag)}))
               for tag in ("x", "y")]
    try:
        time.sleep(0.5)  # both taken in: one compiling, one waiting for the process
        small = {"type": "object", "properties": {"answer": {"type": "string"}}}
        status, answer, seconds = post(server, "/v1/completions", _completion({"guided_json": small}))
        assert status == 200, answer
        assert seconds < SMALL_WITHIN_S, f"{seconds:.1f}s for a one-property schema"

        # the queue for big compiles is full: a third is refused at once, not queued
        refused(server, "/v1/completions", _completion({"guided_json": _optional_properties(600, "z")}),
                "guided_json", "compiling already", within=REFUSED_WITHIN_S)
        workers = set(child_pids(server.proc.pid))
        assert workers, "big grammars compile in a worker process"
    finally:
        for sock in hostile:
            sock.close()

    # nobody waits for the hostile compiles any more: their process is killed, not left running
    deadline = time.monotonic() + KILLED_WITHIN_S
    while workers & set(child_pids(server.proc.pid)):
        assert time.monotonic() < deadline, "the abandoned compile's process still runs"
        time.sleep(0.1)
