"""A pyserve server the stress and soak benchmarks start for themselves: `python -m pyserve`
on a free loopback port, its output in a log file, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PyserveServer:
    def __init__(self, *flags: str, env: dict[str, str] | None = None, timeout_s: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pyserve-bench-", suffix=".log",
                                               delete=False)
        env = {**os.environ, "PYSERVE_LOG_STATS_INTERVAL": "0", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "pyserve", "--host", "127.0.0.1",
                                      "--port", str(self.port), "--enable-debug-endpoints", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at start-up:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def books(self) -> dict:
        """GET /debug/books: {"books", "idle", "balanced", "problems"}."""
        with urllib.request.urlopen(self.url + "/debug/books", timeout=10) as r:
            return json.loads(r.read())

    def wait_balanced(self, wait_s: float = 10.0) -> dict:
        """The books once idle; AssertionError naming the problems if they do not balance."""
        deadline = time.monotonic() + wait_s
        while True:
            answer = self.books()
            if answer["balanced"]:
                return answer["books"]
            if time.monotonic() > deadline:
                raise AssertionError(f"the books do not balance: {answer['problems']}; "
                                     f"{answer['books']}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()
