"""`pyserve chat` and `pyserve complete` end to end, as `vllm chat` / `vllm complete`: the real
commands against a real server on the tiny random model, with --quick and with messages piped
on stdin. The server's defaults are greedy and short (a generation_config.json folder), so each
printed reply must equal what the openai SDK gets for the same conversation."""

import json
import os
import subprocess
import sys

import openai
import pytest

from .server import ServerProcess

pytestmark = pytest.mark.slow
KEY = "client-key"


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    defaults = tmp_path_factory.mktemp("greedy")
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                                 "max_new_tokens": 6}))
    srv = ServerProcess("--served-model-name", "tiny", "--api-key", "other-key", KEY,
                        "--generation-config", str(defaults),
                        command=("serve", str(tiny_model_factory("llama"))))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def run_client(server, *argv, stdin: str = "", key: str | None = KEY):
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if key is not None:
        env["OPENAI_API_KEY"] = key
    # bytes, not text mode: a random model's reply may hold a \r that must not become \n
    done = subprocess.run([sys.executable, "-m", "pyserve", *argv, "--url", server.url + "/v1"],
                          input=stdin.encode(), capture_output=True, timeout=60, env=env)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def chat_reply(sdk, conversation) -> str:
    out = sdk.chat.completions.create(model="tiny", messages=conversation)
    return out.choices[0].message.content


def test_chat_quick_prints_the_reply(server, sdk):
    done = run_client(server, "chat", "--quick", "Hello, world!")
    assert done.returncode == 0, done.stderr
    reply = chat_reply(sdk, [{"role": "user", "content": "Hello, world!"}])
    assert reply
    assert done.stdout == f"Using model: tiny\n{reply}\n"


def test_chat_reads_lines_until_eof_and_keeps_the_conversation(server, sdk):
    done = run_client(server, "chat", "--system-prompt", "Be brief.", "--model-name", "tiny",
                      stdin="Hello, world!\nHow are you today?\n")
    assert done.returncode == 0, done.stderr
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hello, world!"}]
    first = chat_reply(sdk, conversation)
    conversation += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "How are you today?"}]
    second = chat_reply(sdk, conversation)
    assert done.stdout == (f"Using model: tiny\nPlease enter a message for the chat model:\n"
                           f"> {first}\n> {second}\n> ")


def test_complete_quick_with_max_tokens_and_the_key_flag(server, sdk):
    done = run_client(server, "complete", "--quick", "The quick brown fox", "--max-tokens", "3",
                      "--api-key", "other-key", key=None)
    assert done.returncode == 0, done.stderr
    out = sdk.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert done.stdout == f"Using model: tiny\n{out.choices[0].text}\n"


def test_complete_reads_prompts_until_eof(server, sdk):
    prompts = ["Paris is the capital of", "Numbers: 0 1 2"]
    done = run_client(server, "complete", "--stats", stdin="\n".join(prompts) + "\n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[:2] == ["Using model: tiny", "Please enter prompt to complete:"]
    texts = [sdk.completions.create(model="tiny", prompt=p).choices[0].text for p in prompts]
    body = "\n".join(lines[2:])
    for text in texts:  # each reply, then its TTFT / TPS lines (--stats)
        assert f"> {text}\nTTFT: " in body
    assert body.count("TPS:  ") == 2 and body.endswith("> ")


def test_a_wrong_key_is_one_line_and_exit_1(server):
    done = run_client(server, "chat", "--quick", "hi", key="wrong")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "HTTP 401" in done.stderr
