"""The server at --tensor-parallel-size 2 on a tiny random Llama, through the openai SDK:
the same greedy text as the offline engine at size 1; a worker's death turns /health 503,
fails the streaming request and ends the server; SIGTERM leaves no process or segment."""

import os
import time

import openai
import pytest

from pyserve import LLM, SamplingParams

from .server import ServerProcess, child_pids, cmdline, kill_rank_mid_stream

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown fox", "Paris is the capital of", "Numbers: 0 1 2"]


def workers_of(server: ServerProcess) -> list[int]:
    return [p for p in child_pids(server.proc.pid) if "spawn_main" in cmdline(p)]


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"pyserve-tp-{pid}-")]


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_tp2_server_matches_offline_tp1_and_sigterm_cleans_up(model):
    llm = LLM(model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    server = ServerProcess("--model", model, "--tensor-parallel-size", "2")
    try:
        workers = workers_of(server)
        assert len(workers) == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        got = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    finally:
        code = server.stop()
    assert code == 0
    time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{w}") and "spawn_main" in cmdline(w) for w in workers)
    assert child_pids(server.proc.pid) == []
    assert segments_of(server.proc.pid) == []


def test_worker_death_turns_health_503_fails_the_stream_and_exits(model):
    server = ServerProcess("--model", model, "--tensor-parallel-size", "2")
    try:
        (worker,) = workers_of(server)
        took = kill_rank_mid_stream(server, worker, model, "The quick brown fox", 1.0, 10)
        assert took < 1.5
    finally:
        server.stop()
    output = server.output()
    assert "exited with code" in output and "the engine died" in output
    assert segments_of(server.proc.pid) == []
