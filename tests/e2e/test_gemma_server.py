"""A tiny random Gemma 3 (sliding windows of 8 tokens between global layers) served over HTTP:
greedy completions, the prompt longer than the window and split into chunks, carry
transformers' ids."""

import json
import urllib.request

import pytest

from tests.model.reference import hf_greedy, load_hf

from .server import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100. Tokyo is the capital of Japan. Python, C++"


@pytest.fixture(scope="module")
def gemma3(tiny_model_factory):
    return tiny_model_factory("gemma3")


@pytest.fixture(scope="module")
def server(gemma3):
    srv = ServerProcess("--model", str(gemma3), "--max-num-batched-tokens", "16",
                        "--kv-cache-memory", "64MiB", "--enable-debug-endpoints")
    yield srv
    assert srv.stop() == 0


def test_greedy_completion_matches_transformers(server, gemma3):
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(gemma3))(PROMPT)["input_ids"]
    assert len(prompt_ids) > 16
    body = json.dumps({"model": "", "prompt": prompt_ids, "max_tokens": 30, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        answer = json.loads(r.read())
    assert answer["choices"][0]["token_ids"] == hf_greedy(load_hf(gemma3), prompt_ids, 30)
