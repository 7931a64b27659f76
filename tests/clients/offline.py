"""Keeps a client program offline while it runs: only 127.0.0.1 (the test's server) may be
reached, and any attempt at another host is recorded so that the test fails on it.

Two guards, as clients differ in how they reach the network:
- RefusingProxy: a local HTTP proxy that answers every request 403 and records its target.
  HTTP(S)_PROXY and ALL_PROXY point at it, NO_PROXY exempts loopback, so every client that
  honours the proxy variables (Codex's reqwest, Claude Code's runtime, httpx, requests)
  sends its traffic for any other host here, where it is refused and named.
- a sitecustomize for Python clients (python_guard_dir): socket.connect to an address off
  the loopback raises and is recorded too, for libraries that ignore the proxy variables
  (aiohttp without trust_env)."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

_SITECUSTOMIZE = '''
import os, socket

_log = os.environ["PYSERVE_OFFLINE_LOG"]
_connect = socket.socket.connect


def _loopback(address):
    host = address[0] if isinstance(address, tuple) else None
    return host is None or host in ("localhost", "::1") or str(host).startswith("127.")


def _guarded(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address):
        with open(_log, "a") as f:
            f.write(f"connect {address!r}\\n")
        raise OSError(101, f"offline test: connecting to {address!r} is not allowed")
    return _connect(self, address)


socket.socket.connect = _guarded
'''


class RefusingProxy:
    """An HTTP proxy on 127.0.0.1 that refuses everything (403) and records what was asked."""

    def __init__(self, log: Path):
        self.log = log
        self.attempts: list[str] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    head = conn.recv(8192).split(b"\r\n", 1)[0].decode(errors="replace")
                    self.attempts.append(f"proxy {head}")
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()

    def env(self, home: Path) -> dict[str, str]:
        """The environment a client runs in: the proxy for every scheme, loopback exempt,
        the Python guard on PYTHONPATH, HOME (and XDG dirs) in a scratch folder."""
        guard = home / ".offline-guard"
        guard.mkdir(parents=True, exist_ok=True)
        (guard / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        env = {k: v for k, v in os.environ.items()
               if not k.lower().endswith("_proxy") and not k.startswith(("OPENAI_", "ANTHROPIC_"))}
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env[name] = env[name.lower()] = self.url
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
        env["PYTHONPATH"] = str(guard)
        env["PYSERVE_OFFLINE_LOG"] = str(self.log)
        env["HOME"] = str(home)
        env["XDG_CONFIG_HOME"], env["XDG_CACHE_HOME"] = str(home / ".config"), str(home / ".cache")
        return env

    def tries(self) -> list[str]:
        """Every attempt to reach another host so far, from both guards."""
        guarded = self.log.read_text().splitlines() if self.log.exists() else []
        return self.attempts + guarded
