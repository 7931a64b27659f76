"""How the event loop awaits a step queued on a CUDA stream with no thread blocked on it.

The model thread queues the step's kernels and the copy of its results, then a host function
(pyserve._C.notify_when_done) that writes to an eventfd once the stream reaches it; the loop
watches the eventfd like a socket and resumes the step loop when it becomes readable."""

from __future__ import annotations

import asyncio
import os


class StepCompletion:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._waiter: asyncio.Future | None = None
        loop.add_reader(self.fd, self._on_readable)

    def arm(self) -> asyncio.Future:
        """Before queueing a step: the future its notification completes."""
        self._waiter = self._loop.create_future()
        return self._waiter

    def _on_readable(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            return
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self._loop.remove_reader(self.fd)
        os.close(self.fd)
