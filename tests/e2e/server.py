"""Starts `python -m pyserve` as a subprocess on a free loopback port, for end-to-end tests."""

import os
import signal
import socket
import subprocess
import sys
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


class ServerProcess:
    def __init__(self, *flags: str, timeout: float = 120.0, command: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        """command: what comes before the flags (e.g. ("serve", MODEL)); env: variables added
        to this process's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYSERVE_LOG_STATS_INTERVAL": "0", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "pyserve", *command, "--host",
                                      "127.0.0.1", "--port", str(self.port), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
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
