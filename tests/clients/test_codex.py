"""OpenAI's Codex CLI (pinned in installs.py) against pyserve over the Responses API, offline:
`codex exec` one turn, then `codex exec resume` a second turn of the same session.

Codex sends its function tools, a namespace of them and the hosted tool web_search
({"type": "web_search", "external_web_access": false}) with every request; pyserve leaves the
hosted tool out of the prompt, as vLLM does, and says so in its log (before, the request was
a 400 and Codex exited 1)."""

import json
import re
import subprocess

import pytest

from .conftest import MODEL, agent_server
from .installs import npm_client

pytestmark = pytest.mark.clients
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def codex():
    return npm_client("codex")


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    srv = agent_server(tiny_model_factory, tmp_path_factory, "--api-key", "codex-key")
    yield srv
    assert srv.stop() == 0


def config(server) -> str:
    """A custom provider on the Responses API (what docs/serving.md tells users to write)."""
    return (f'model = "{MODEL}"\nmodel_provider = "pyserve"\n'
            # no update check, analytics, plugin sync (GitHub, chatgpt.com) or connectors
            "check_for_update_on_startup = false\n"
            "[analytics]\nenabled = false\n"
            "[features]\nplugins = false\nremote_plugin = false\napps = false\n"
            "[model_providers.pyserve]\n"
            'name = "pyserve"\n'
            f'base_url = "{server.url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "PYSERVE_API_KEY"\n')


def run_codex(codex, env, workdir, *argv):
    done = subprocess.run([str(codex), "exec", *argv], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"codex exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_exec_one_turn_then_a_resumed_second_turn(codex, server, offline, tmp_path):
    env, _ = offline
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(config(server))
    env = {**env, "CODEX_HOME": str(home), "PYSERVE_API_KEY": "codex-key"}
    work = tmp_path / "work"
    work.mkdir()
    first = run_codex(codex, env, work, "--skip-git-repo-check", "--json", "say hello")
    started = [e for e in events(first.stdout) if e.get("type") == "thread.started"]
    assert started, first.stdout
    thread = started[0]["thread_id"]
    assert any(e.get("type") == "turn.completed" for e in events(first.stdout)), first.stdout
    second = run_codex(codex, env, work, "resume", "--skip-git-repo-check", "--json", thread,
                       "and now goodbye")
    assert any(e.get("type") == "turn.completed" for e in events(second.stdout)), second.stdout
    # the server saw both turns, each with web_search left out and named in its log
    log = server.output()
    left_out = re.findall(r"request (resp_\w+): hosted tools left out of the prompt \(this "
                          r"server does not run them\): web_search", log)
    assert len(set(left_out)) >= 2, log[-3000:]
    # the second turn carried the first (Codex stores nothing on the server: store false)
    usage = [e["usage"] for out in (first, second) for e in events(out.stdout)
             if e.get("type") == "turn.completed"]
    assert usage[1]["input_tokens"] > usage[0]["input_tokens"]
