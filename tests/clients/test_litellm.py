"""LiteLLM (pinned in installs.py, its own environment) against pyserve, offline: the
`hosted_vllm/` provider (completions whole and streamed; tools auto, required and named, and a
tool round trip), its `anthropic/` provider on /v1/messages and its Responses API. A regex
grammar (structured_outputs, through LiteLLM's extra_body) scripts the text, and the hermes
text of the "auto" call, that a 135M model would not write."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess, regex_for

from .installs import python_client

pytestmark = pytest.mark.clients
MODEL = "SmolLM2-135M-Instruct"
KEY = "litellm-key"
PARIS = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--api-key", KEY,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0


def test_litellm_providers_and_tools(server, offline):
    env, _ = offline
    env = {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}  # no fetch of the price list
    python = python_client("litellm") / "python"
    done = subprocess.run([str(python), str(Path(__file__).with_name("run_litellm.py")), server.url,
                           KEY, MODEL, regex_for(PARIS)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    # LiteLLM prints notices of its own (an empty line, "Provider List: ..."): the script's
    # lines are the JSON objects
    got = {line["name"]: line for line in map(json.loads, (
        text for text in done.stdout.splitlines() if text.startswith("{")))}
    assert got["completion"]["text"] == PARIS and got["completion"]["finish"] == "stop"
    assert got["stream"]["text"] == PARIS
    for mode in ("auto", "required", "named"):
        calls = got[f"tools {mode}"]["calls"]
        assert [c["name"] for c in calls] == ["add"], (mode, got[f"tools {mode}"])
        # a named choice ends "stop" in vLLM (the call is the answer, not the model's choice)
        assert got[f"tools {mode}"]["finish"] in (("tool_calls", "stop") if mode == "named" else ("tool_calls",))
    assert got["tools auto"]["calls"][0]["arguments"] == {"a": 12, "b": 30}
    assert got["tool round trip"]["text"] == PARIS
    assert got["anthropic"]["text"] == PARIS and got["anthropic"]["finish"] == "stop"
    assert got["responses"]["text"] == PARIS and got["responses"]["status"] == "completed"
