"""/health polled every 0.1 s from a thread while a hostile request runs: the worst time the
server's event loop took to answer during it (a poll still waiting when the case ends counts
for as long as it has waited)."""

from __future__ import annotations

import http.client
import threading
import time


class HealthWatch:
    def __init__(self, port: int, every_s: float = 0.1, timeout_s: float = 120.0):
        self.port, self.every_s, self.timeout_s = port, every_s, timeout_s
        self.times: list[float] = []
        self.failures: list[str] = []
        self._in_flight_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        waiting_since = self._in_flight_since
        if waiting_since is not None:
            self.times.append(time.monotonic() - waiting_since)
        self._thread.join(timeout=1.0)

    @property
    def worst_s(self) -> float:
        return max(self.times, default=0.0)

    def _poll(self) -> None:
        while not self._stop.is_set():
            started = self._in_flight_since = time.monotonic()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
                conn.request("GET", "/health")
                status = conn.getresponse().status
                conn.close()
                if status != 200:
                    self.failures.append(f"status {status}")
            except OSError as exc:
                self.failures.append(repr(exc))
            self._in_flight_since = None
            if not self._stop.is_set():
                self.times.append(time.monotonic() - started)
            self._stop.wait(self.every_s)
