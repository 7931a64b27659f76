"""Background responses (background: true), OpenAI's background mode as vLLM serves it.

The POST admits the chat request as a stream (so every refusal is still the POST's 4xx) and
answers at once with the response "queued"; a task reads the chat stream through the same
events a streamed create sends: the stored response turns "in_progress" at the first chat
chunk (the engine's first output), then "completed", "incomplete" or "failed" with the final
response. Cancelling the task (POST .../cancel, or DELETE while it runs) ends it "cancelled"
with no output: the cancellation reaches the chat stream's pending read, whose end discards
the engine request, so its KV blocks are freed.

Invariants: while its task lives a response is in the store's running set (never evicted);
the task alone moves it out (store.finish), whatever ended it; a stream's event log ends
exactly when the task does, so no reader waits forever. A background stream (stream: true
too) records each event's bytes in an EventLog, which the POST streams and GET ?stream=true
replays from any sequence number, the client leaving either stream stopping nothing."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator

from pyserve.server.openai.responses.output import TERMINAL_EVENTS, Turn, sse
from pyserve.server.openai.responses.store import ResponseStore, Stored
from pyserve.server.openai.responses.items import with_answer

logger = logging.getLogger("pyserve.requests")

# ended background streams whose events GET ?stream=true can still replay
KEPT_EVENT_LOGS = 64


class EventLog:
    """A background stream's events as sent (SSE bytes; event i has sequence_number i),
    appended by its task and read by any number of streams, each from its own position."""

    def __init__(self):
        self.events: list[bytes] = []
        self.ended = False
        self._wake = asyncio.Event()  # set, and replaced, at each change

    def _changed(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    def append(self, data: bytes) -> None:
        self.events.append(data)
        self._changed()

    def end(self) -> None:
        self.ended = True
        self._changed()

    async def read(self, start: int = 0) -> AsyncIterator[bytes]:
        """The events from index start on, as they come, until the log ends."""
        at = max(start, 0)
        while True:
            wake = self._wake  # taken before looking, so no append in between goes unseen
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.ended:
                return
            await wake.wait()


class BackgroundRuns:
    """The tasks of the background responses still running, by response id."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._tasks: dict[str, asyncio.Task] = {}
        self._kept_logs: deque[Stored] = deque()  # ended streams whose events are kept, oldest first

    def start(self, turn: Turn, chunks, conversation: list[dict], streamed: bool,
              owner: int | None = None) -> Stored:
        """Stores the response "queued" (owner's: the API key that made it) and starts reading
        chunks (the chat stream, already admitted). A task's first step runs before any later
        request is read (call_soon order), so the chat stream has been entered, and is closed
        by the task, before a cancel can come."""
        entry = self.store.put_running(turn.response("queued", []), conversation,
                                       EventLog() if streamed else None, owner)
        task = asyncio.get_running_loop().create_task(self._run(turn, chunks, entry),
                                                      name=f"background {turn.id}")
        self._tasks[turn.id] = task
        task.add_done_callback(lambda _: self._tasks.pop(turn.id, None))
        return entry

    def is_running(self, response_id: str) -> bool:
        task = self._tasks.get(response_id)
        return task is not None and not task.done()

    async def cancel(self, response_id: str) -> None:
        """Cancels a running response's task and waits for its end (the response "cancelled")."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    async def _run(self, turn: Turn, chunks, entry: Stored) -> None:
        final, log, sent = None, entry.events, 0
        try:
            first = await anext(chunks, None)
            entry.response = turn.response("in_progress", [])
            async for event in turn.events(chunks, first, []):
                sent += 1
                if log is not None:
                    log.append(sse(event))
                if event["type"] in TERMINAL_EVENTS:
                    final = event["response"]
        except asyncio.CancelledError:
            final = turn.response("cancelled", [])
        except Exception as exc:  # a bug: this response fails, the server goes on
            logger.exception("background response %s failed", turn.id)
            final = turn.response("failed", [], error={"code": "server_error",
                                                       "message": f"generation failed: {exc}"})
            if log is not None:  # a stream's readers see how it ended, as on an engine error
                log.append(sse({"type": "response.failed", "sequence_number": sent, "response": final}))
        finally:
            try:
                await chunks.aclose()  # a no-op once the chat stream ended; else its end aborts it
            finally:
                if log is not None:
                    log.end()
                # whatever ended the run, the response leaves the running set (never stuck
                # in_progress): with the answer in its conversation where that can be built
                conversation = entry.conversation
                if final is None:  # the events always end with a terminal one; guard anyway
                    final = turn.response("failed", [], error={
                        "code": "server_error", "message": "generation ended without a response"})
                if final["status"] in ("completed", "incomplete"):
                    try:
                        conversation = with_answer(conversation, final["output"], turn.continues)
                    except Exception:  # the output cannot be continued from (too many items)
                        logger.exception("background response %s: its output kept out of its conversation", turn.id)
                self.store.finish(final, conversation)
                if log is not None:
                    self._keep_log(entry)

    def _keep_log(self, entry: Stored) -> None:
        """An ended stream's events stay for GET ?stream=true while it is among the
        KEPT_EVENT_LOGS most recently ended ones; older ones' are dropped (their memory grows
        with their output: about 200 bytes a token)."""
        self._kept_logs.append(entry)
        while len(self._kept_logs) > KEPT_EVENT_LOGS:
            self._kept_logs.popleft().events = None
