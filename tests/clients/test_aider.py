"""aider (pinned in installs.py, its own environment) against pyserve, offline: one
non-interactive message (`--message`) in a scratch git repository, through aider's OpenAI
provider. The reply is scripted by a regex grammar (structured_outputs), given in aider's model
settings file as an extra body field, so the test knows what aider must print."""

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess, regex_for

from .installs import python_client

pytestmark = pytest.mark.clients
MODEL = "SmolLM2-135M-Instruct"
KEY = "aider-key"
REPLY = "Hello from pyserve."


@pytest.fixture(scope="module")
def server(default_model_dir):
    srv = ServerProcess("--served-model-name", MODEL, "--api-key", KEY)
    yield srv
    assert srv.stop() == 0


def test_one_message_in_a_git_repository(server, offline, tmp_path):
    env, _ = offline
    env = {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    # aider fetches LiteLLM's price list from GitHub unless a cache of it younger than a day
    # holds something: one that holds this model
    caches = Path(env["HOME"]) / ".aider" / "caches"
    caches.mkdir(parents=True)
    (caches / "model_prices_and_context_window.json").write_text(json.dumps({MODEL: {
        "litellm_provider": "openai", "mode": "chat", "max_input_tokens": 8192,
        "max_output_tokens": 32, "input_cost_per_token": 0.0, "output_cost_per_token": 0.0}}))
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env=env)
    (repo / "hello.py").write_text("print('hello')\n")
    subprocess.run(["git", "add", "hello.py"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", "first"], cwd=repo, check=True, env=env)
    settings = tmp_path / "models.yml"
    settings.write_text(json.dumps([{  # YAML is a superset of JSON
        "name": f"openai/{MODEL}", "edit_format": "whole",
        "extra_params": {"max_tokens": 32, "temperature": 0,
                         "extra_body": {"structured_outputs": {"regex": regex_for(REPLY)}}}}]))
    # python -m: the venv's scripts name the folder it was built in (installs.py renames it)
    python = python_client("aider") / "python"
    done = subprocess.run(
        [str(python), "-m", "aider", "--model", f"openai/{MODEL}", "--openai-api-base", f"{server.url}/v1",
         "--openai-api-key", KEY, "--model-settings-file", str(settings), "--message",
         "Say hello.", "--yes-always", "--no-check-update", "--no-analytics",
         "--no-show-model-warnings", "--no-auto-commits", "--no-pretty", "--no-stream",
         "--map-tokens", "0", "--no-gitignore", "--no-show-release-notes", "--no-detect-urls"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert REPLY in done.stdout, done.stdout[-3000:]
    history = (repo / ".aider.chat.history.md").read_text()
    assert "Say hello." in history and REPLY in history
