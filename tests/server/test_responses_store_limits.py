"""The Responses store against hostile use, over a real socket against a real server on the
tiny random model with two API keys: a stored response is its key's alone (another key's GET,
DELETE, cancel, replay, previous_response_id and input_tokens answer 404 as for an id never
stored), the identifiers echoed in every stored response are OpenAI's 64 characters at most,
and the store is bounded by size as well as by count (--max-stored-response-bytes). Issue 68,
items 5 and 9."""

import http.client
import json
import time

import pytest

from tests.e2e.server import ServerProcess, assert_books_balanced

from .hostile import MODEL

K1, K2 = "key-one", "key-two"
STORE_BYTES = 96 * 1024  # --max-stored-response-bytes here: a few responses of big metadata
# OpenAI's largest metadata (16 keys of 64 characters, values of 512): about 9 KB a response
BIG_METADATA = {f"{i:02d}".ljust(64, "k"): "v" * 512 for i in range(16)}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    srv = ServerProcess("--served-model-name", MODEL, "--enable-debug-endpoints", "--kv-cache-memory",
                        "16MiB", "--api-key", K1, K2, "--max-stored-response-bytes", str(STORE_BYTES),
                        command=("serve", str(tiny_model_factory("llama"))))
    yield srv
    assert srv.proc.poll() is None, "the server died"
    assert_books_balanced(srv.url, K1)
    assert srv.stop() == 0


def call(srv, method: str, path: str, body=None, key: str = K1, header: str = "bearer") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    auth = {"authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"content-type": "application/json", **auth})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def create(srv, key: str = K1, **fields) -> dict:
    status, answer = call(srv, "POST", "/v1/responses", {
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0, **fields}, key)
    assert status == 200, answer
    return answer


def not_found(status_answer, param: str = "response_id") -> None:
    status, answer = status_answer
    assert status == 404, answer
    assert answer["error"]["param"] == param and "not found" in answer["error"]["message"], answer


def test_a_stored_response_is_its_keys_alone(server):
    made = create(server)
    rid = made["id"]
    not_found(call(server, "GET", f"/v1/responses/{rid}", key=K2))
    not_found(call(server, "GET", f"/v1/responses/{rid}", key=K2, header="x-api-key"))
    not_found(call(server, "GET", f"/v1/responses/{rid}?stream=true", key=K2))
    not_found(call(server, "POST", f"/v1/responses/{rid}/cancel", key=K2))
    not_found(call(server, "DELETE", f"/v1/responses/{rid}", key=K2))
    chained = {"model": MODEL, "input": "more", "max_output_tokens": 2, "previous_response_id": rid}
    not_found(call(server, "POST", "/v1/responses", chained, K2), "previous_response_id")
    not_found(call(server, "POST", "/v1/responses/input_tokens", chained, K2), "previous_response_id")
    # the key that made it (by either header) still has all of it
    status, got = call(server, "GET", f"/v1/responses/{rid}", key=K1, header="x-api-key")
    assert status == 200 and got["id"] == rid and got["output"] == made["output"]
    assert create(server, previous_response_id=rid)["status"] in ("completed", "incomplete")
    assert call(server, "POST", "/v1/responses/input_tokens", chained, K1)[0] == 200
    # key two's own response is its own, and key one cannot delete it
    theirs = create(server, K2)["id"]
    not_found(call(server, "DELETE", f"/v1/responses/{theirs}", key=K1))
    assert call(server, "GET", f"/v1/responses/{theirs}", key=K2)[0] == 200
    assert call(server, "DELETE", f"/v1/responses/{rid}", key=K1)[1]["deleted"] is True
    not_found(call(server, "GET", f"/v1/responses/{rid}", key=K1))


def test_a_background_response_and_its_cancel_are_its_keys_alone(server):
    made = create(server, background=True, stream=False, max_output_tokens=64)
    rid = made["id"]
    not_found(call(server, "GET", f"/v1/responses/{rid}", key=K2))
    not_found(call(server, "POST", f"/v1/responses/{rid}/cancel", key=K2))
    not_found(call(server, "DELETE", f"/v1/responses/{rid}", key=K2))
    deadline = time.monotonic() + 60
    while True:  # it runs on, untouched by key two
        status, got = call(server, "GET", f"/v1/responses/{rid}", key=K1)
        assert status == 200 and got["status"] != "cancelled", got
        if got["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got["status"] in ("completed", "incomplete"), got
    not_found(call(server, "GET", f"/v1/responses/{rid}", key=K2))


@pytest.mark.parametrize("name", ["user", "safety_identifier", "prompt_cache_key"])
def test_echoed_identifiers_are_at_most_64_characters(server, name):
    assert create(server, **{name: "u" * 64})[name] == "u" * 64
    status, answer = call(server, "POST", "/v1/responses", {
        "model": MODEL, "input": "hi", "max_output_tokens": 2, name: "u" * 8 * 1024 * 1024})
    assert status == 400 and answer["error"]["param"] == name, answer
    assert "64" in answer["error"]["message"]


def test_the_store_is_bounded_by_size(server):
    ids = [create(server, metadata=BIG_METADATA)["id"] for _ in range(24)]  # ~216 KB in all
    kept = [call(server, "GET", f"/v1/responses/{rid}")[0] == 200 for rid in ids]
    assert kept[-1] and kept[-2], kept  # the most recent stay
    assert not kept[0], kept  # the oldest went, with far fewer than 1,000 stored
    assert 3 <= sum(kept) <= 12, kept  # about STORE_BYTES' worth
    assert kept == sorted(kept), kept  # least recently used first
