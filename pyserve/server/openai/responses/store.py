"""Stored responses, in memory, for GET / DELETE /v1/responses/{id} and previous_response_id:
each keeps the response object and its whole conversation as chat messages (the input of
every earlier turn, this input, this output), so a later turn needs only its one entry.

Bounded by entry count: past MAX_ENTRIES the least recently used (stored or read) ended
response goes. A background response still running (queued or in_progress) is held apart,
never evicted, so that its run always finds its entry and GET always finds the run; it joins
the least-recently-used order, as the most recent, when it ends (finish). Each running entry
is an engine request: --max-num-queued-requests bounds them where it is set (without it they
are unbounded, as in vLLM)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyserve.server.openai.responses.background import EventLog

MAX_ENTRIES = 1000


@dataclass
class Stored:
    response: dict
    conversation: list[dict]
    events: EventLog | None = None  # a background stream's, for GET ?stream=true


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # ended responses, LRU first
        self._running: dict[str, Stored] = {}

    def __len__(self) -> int:
        return len(self._entries) + len(self._running)

    def put(self, response: dict, conversation: list[dict]) -> Stored:
        """Stores a response that has ended (completed, incomplete)."""
        return self._keep(response["id"], Stored(response, conversation))

    def put_running(self, response: dict, conversation: list[dict],
                    events: EventLog | None = None) -> Stored:
        """Stores a background response that has not ended; nothing evicts it until finish."""
        entry = self._running[response["id"]] = Stored(response, conversation, events)
        return entry

    def finish(self, response: dict, conversation: list[dict]) -> bool:
        """A running response ended: its entry now holds this response and conversation, in the
        bounded order. False (nothing stored) if it was deleted meanwhile."""
        entry = self._running.pop(response["id"], None)
        if entry is None:
            return False
        entry.response, entry.conversation = response, conversation
        self._keep(response["id"], entry)
        return True

    def _keep(self, response_id: str, entry: Stored) -> Stored:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return entry

    def get(self, response_id: str) -> Stored | None:
        entry = self._running.get(response_id)
        if entry is not None:
            return entry
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def is_running(self, response_id: str) -> bool:
        return response_id in self._running

    def delete(self, response_id: str) -> bool:
        return (self._running.pop(response_id, None) or self._entries.pop(response_id, None)) is not None
