"""Anthropic's Claude Code (pinned in installs.py) against pyserve's /v1/messages, offline:
`claude -p` plain and with `--output-format stream-json`, and a session whose history holds a
tool_use and its tool_result, resumed with `--resume`.

Claude Code asks for max_tokens 32000 unless CLAUDE_CODE_MAX_OUTPUT_TOKENS says less (a
model length below prompt + max_tokens is a 400, as in vLLM); its prompt is long, hence the
long model length of agent_server. The tiny random model writes no text or tool call of its
own: a regex grammar (structured_outputs, sent through Claude Code's CLAUDE_CODE_EXTRA_BODY)
scripts its replies, and in the tool session a hermes tool call of Read on a file the test
wrote, which --tool-call-parser hermes turns into a tool_use block; Claude Code runs it and
sends the tool_result back."""

import json
import subprocess

import pytest

from tests.e2e.server import regex_for

from .conftest import MODEL, agent_server
from .installs import npm_client

pytestmark = pytest.mark.clients
TIMEOUT_S = 300
KEY = "claude-key"
REPLY = "Hello from pyserve."


@pytest.fixture(scope="module")
def claude():
    return npm_client("claude-code")


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    srv = agent_server(tiny_model_factory, tmp_path_factory, "--api-key", KEY,
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def claude_env(server, offline, tmp_path):
    env, _ = offline
    return {**env, "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY,
            # every model role it has is the one served model
            "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
            # the reply scripted (a random model never ends its turn; Claude Code takes an
            # answer cut at max_tokens for an error)
            "CLAUDE_CODE_EXTRA_BODY": json.dumps({"structured_outputs": {"regex": regex_for(REPLY)}}),
            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
            # no telemetry, error reports, update checks or other calls home
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}


def run_claude(claude, env, cwd, *argv, ok: bool = True):
    done = subprocess.run([str(claude), "-p", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    if ok:
        assert done.returncode == 0, f"claude exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def stream(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_print_mode_plain_and_stream_json(claude, claude_env, tmp_path):
    plain = run_claude(claude, claude_env, tmp_path, "say hello")
    assert plain.stdout.strip() == REPLY
    events = stream(run_claude(claude, claude_env, tmp_path, "--output-format", "stream-json",
                               "--verbose", "say hello").stdout)
    assert events[0]["type"] == "system" and events[0]["model"] == MODEL
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"]
    assert result["result"] == REPLY
    assert any(e["type"] == "assistant" for e in events)


def test_resumed_session_with_a_tool_use_and_its_result(claude, claude_env, tmp_path):
    note = tmp_path / "note.txt"
    note.write_text("the answer is 42\n")
    call = f'<tool_call>{{"name": "Read", "arguments": {{"file_path": "{note}"}}}}</tool_call>'
    scripted = {**claude_env, "CLAUDE_CODE_EXTRA_BODY": json.dumps(
        {"structured_outputs": {"regex": regex_for(call)}})}
    # every turn of this session is the same call: it ends at --max-turns, its history saved
    first = run_claude(claude, scripted, tmp_path, "--output-format", "stream-json", "--verbose",
                       "--max-turns", "2", "--allowedTools", "Read", "--", "read note.txt", ok=False)
    events = stream(first.stdout)
    assert events, first.stdout + first.stderr
    session = events[0]["session_id"]
    uses = [block for e in events if e["type"] == "assistant"
            for block in e["message"]["content"] if block["type"] == "tool_use"]
    results = [block for e in events if e["type"] == "user"
               for block in e["message"]["content"] if block.get("type") == "tool_result"]
    assert uses and uses[0]["name"] == "Read" and uses[0]["input"] == {"file_path": str(note)}, first.stdout
    assert results and results[0]["tool_use_id"] == uses[0]["id"]
    assert "the answer is 42" in json.dumps(results[0]["content"])
    # resumed without the grammar: the history (tool_use, tool_result) goes back to the server
    resumed = stream(run_claude(claude, claude_env, tmp_path, "--resume", session,
                                "--output-format", "stream-json", "--verbose", "thanks").stdout)
    result = resumed[-1]
    assert result["type"] == "result" and result["subtype"] == "success", resumed
    assert result["result"] == REPLY and result["session_id"] == session
    assert result["usage"]["input_tokens"] > 0
