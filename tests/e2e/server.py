"""Starts `python -m pyserve` as a subprocess on a free loopback port, for end-to-end tests.

Every server starts with --enable-debug-endpoints (unless check_books=False) and has its books
checked when it is stopped with SIGTERM (GET /debug/books, waiting briefly for idle:
engine/books.py); the e2e conftest's autouse fixture fails the module if any of its servers'
books did not balance."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def regex_for(text: str) -> str:
    """A regex matching exactly text: a grammar that makes the model write it (a 135M model
    writes no tool calls or think tags of its own)."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else c for c in text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch_books(url: str, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/debug/books", headers=headers),
                                timeout=5) as r:
        return json.loads(r.read())


def assert_books_balanced(url: str, api_key: str | None = None, wait_s: float = 5.0) -> dict:
    """The server's books balance once it is idle (streams of clients that just left take a
    step to end): polls GET /debug/books for up to wait_s; returns the books."""
    deadline = time.monotonic() + wait_s
    while True:
        answer = fetch_books(url, api_key)
        if answer["balanced"]:
            return answer["books"]
        if time.monotonic() > deadline:
            raise AssertionError(f"the books of {url} do not balance: {answer['problems']}; "
                                 f"books: {answer['books']}")
        time.sleep(0.05)


# (server, AssertionError or None) for each server whose books stop() checked; the e2e
# conftest's module fixture empties it at the start of a module and asserts it at the end
BOOKS_CHECKED: list = []


class ServerProcess:
    def __init__(self, *flags: str, timeout: float = 120.0, command: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, check_books: bool = True):
        """command: what comes before the flags (e.g. ("serve", MODEL)); env: variables added
        to this process's; check_books: add --enable-debug-endpoints, so that stop() checks
        the books (False: a server that must not serve /debug/books)."""
        if check_books and "--enable-debug-endpoints" not in flags:
            flags = (*flags, "--enable-debug-endpoints")
        self.debug_endpoints = "--enable-debug-endpoints" in flags
        env = {**os.environ, "PYSERVE_LOG_STATS_INTERVAL": "0", **(env or {})}
        # the key the books are fetched with: --api-key's first, else vLLM's variable
        self.api_key = (flags[flags.index("--api-key") + 1] if "--api-key" in flags
                        else env.get("VLLM_API_KEY") or None)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pyserve", *command, "--host",
                                      "127.0.0.1", "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        # The log is read as it comes: a pipe nobody drains fills (64 KiB) and then blocks the
        # server's next log line, its event loop with it (a fuzzing run logs a line a request).
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    def output(self) -> str:
        """The server's log (stdout and stderr) so far; all of it once the process ended."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self._lines)

    def logged(self, text: str, wait_s: float = 5.0) -> bool:
        """Whether the server's log holds text, waiting up to wait_s for it (a line written as
        a response went out may reach the reader thread a moment after the client has it)."""
        deadline = time.monotonic() + wait_s
        while text not in self.output():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.debug_endpoints and sig == signal.SIGTERM and self.proc.poll() is None:
            try:
                assert_books_balanced(self.url, self.api_key)
                BOOKS_CHECKED.append((self, None))
            except (AssertionError, OSError) as exc:
                BOOKS_CHECKED.append((self, exc))
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is pid (from /proc)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry))
    return children


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def health_status(url: str) -> int:
    """GET /health's status code; -1 when nothing answers."""
    import urllib.error

    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1


def kill_rank_mid_stream(server: "ServerProcess", pid: int, model: str, prompt: str,
                         health_within_s: float, exit_within_s: float) -> float:
    """SIGKILLs another rank's process while a stream runs: the stream fails, /health turns
    503 within health_within_s and the server exits 1 within exit_within_s. Returns the
    seconds from the kill to the 503."""
    import openai
    import pytest

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    while health_status(server.url) == 200 and time.monotonic() - killed < health_within_s:
        time.sleep(0.02)
    took = time.monotonic() - killed
    assert health_status(server.url) == 503, f"/health not 503 within {health_within_s}s of the kill"
    assert server.proc.wait(exit_within_s) == 1  # the server exits rather than hang
    return took


def served_greedy_equals_offline(path, offline, name: str, max_tokens: int) -> str:
    """Serves the model at path and asks it, through the openai SDK over a real socket, for
    each offline RequestOutput's prompt (greedy, ignore_eos): the same token ids. Returns the
    server's log."""
    import openai

    srv = ServerProcess("--served-model-name", name, command=("serve", str(path)))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for out in offline:
            got = client.completions.create(model=name, prompt=out.prompt, max_tokens=max_tokens,
                                            temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            assert got.choices[0].token_ids == out.outputs[0].token_ids
        return srv.output()
    finally:
        assert srv.stop() == 0
