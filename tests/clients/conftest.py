"""Fixtures of the real-client tests (marker `clients`): a server on a tiny random model with a
long model length (the coding agents' prompts are thousands of tokens), the offline guard,
and the books check of tests/e2e at the end of each module."""

import json

import pytest

from tests.e2e.server import BOOKS_CHECKED, ServerProcess

from .offline import RefusingProxy

MODEL = "tiny"


@pytest.fixture(autouse=True, scope="module")
def books_balanced():
    BOOKS_CHECKED.clear()
    yield
    failed = [f"{server.url}: {exc}" for server, exc in BOOKS_CHECKED if exc is not None]
    BOOKS_CHECKED.clear()
    assert not failed, "\n".join(failed)


@pytest.fixture
def offline(tmp_path):
    """(the environment to run a client in, the guard): the test fails if the client tried
    to reach any host but 127.0.0.1."""
    proxy = RefusingProxy(tmp_path / "offline.log")
    home = tmp_path / "home"
    home.mkdir()
    yield proxy.env(home), proxy
    proxy.close()
    assert proxy.tries() == [], f"the client tried to reach other hosts: {proxy.tries()}"


def agent_server(tiny_model_factory, tmp_path_factory, *flags: str) -> ServerProcess:
    """A server for the coding agents: the tiny llama model at a 64k model length (beyond its
    own positions, as VLLM_ALLOW_LONG_MAX_MODEL_LEN allows: its text is random anyway), greedy
    and short by default (a generation_config.json folder)."""
    defaults = tmp_path_factory.mktemp("agent-defaults")
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                                 "max_new_tokens": 8}))
    return ServerProcess("--served-model-name", MODEL, "--max-model-len", "65536",
                         "--generation-config", str(defaults), *flags,
                         command=("serve", str(tiny_model_factory("llama"))),
                         env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
