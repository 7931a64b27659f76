"""Fairness between requests under load, through the real server (issue 68, item 10).

A big embedding batch is one HTTP request fanned out into one engine request per input; a
completion sent while it runs must not wait behind all of it (the batch is fed a window at a
time: server/openai/pooling_window.py)."""

import json
import threading
import time
import urllib.request

import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny"


def post(url: str, path: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        assert r.status == 200
        return json.loads(r.read())


def gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    """Steps of 16 tokens, at most 8 sequences: a batch of short inputs takes many steps (the
    fairness is counted in steps, whatever a step costs on the machine running the test)."""
    srv = ServerProcess("--model", str(tiny_model_factory("llama")), "--served-model-name", MODEL,
                        "--max-num-batched-tokens", "16", "--max-num-seqs", "8")
    yield srv
    assert srv.stop() == 0


def test_completion_not_held_behind_an_embedding_batch(server):
    """400 inputs of 4 tokens take about 100 steps; a 2-token completion sent once the batch
    runs ends within a fifth of the time the batch still needed (it waits behind two steps'
    worth of the batch, then shares the steps with it). Before the fix every input stood
    before it in the queue: it ended just after the batch."""
    inputs = [[5, 6, 7, 10 + i % 400] for i in range(400)]
    batch: dict = {}

    def embed():
        batch["body"] = post(server.url, "/v1/embeddings", {"model": MODEL, "input": inputs})
        batch["done"] = time.monotonic()

    thread = threading.Thread(target=embed)
    thread.start()
    deadline = time.monotonic() + 60
    while gauge(server.url, "vllm:num_requests_running") == 0:  # the batch has begun
        assert time.monotonic() < deadline, "the batch never ran"
        time.sleep(0.005)
    sent = time.monotonic()
    answer = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                  "temperature": 0, "ignore_eos": True})
    waited = time.monotonic() - sent
    thread.join(300)
    assert answer["usage"]["completion_tokens"] == 2
    assert len(batch["body"]["data"]) == len(inputs)
    batch_left = batch["done"] - sent
    assert waited < batch_left / 5, (f"the completion took {waited:.2f}s while the batch it was "
                                     f"sent beside needed {batch_left:.2f}s more")


def test_a_chat_burst_sharing_a_prefix_runs_together(server):
    """8 chat requests sharing a long system prompt, sent at once: the first computes the
    shared blocks, the others take them from the prefix cache, and all decode together (the
    most running at once, as /metrics reports it, is all of them), none waiting for
    another's end."""
    system = "You are a careful assistant who answers in one short sentence. " * 6
    n = 8
    done = []
    peak = 0

    def chat(i):
        body = post(server.url, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question {i}: what is {i} + {i}?"}]})
        done.append(body["usage"]["completion_tokens"])

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, gauge(server.url, "vllm:num_requests_running"))
        time.sleep(0.005)
    for t in threads:
        t.join()
    assert done == [48] * n
    assert peak == n, f"at most {peak:.0f} of the {n} requests ran at once"
