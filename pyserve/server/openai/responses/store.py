"""Stored responses, in memory, for GET / DELETE /v1/responses/{id} and previous_response_id:
each keeps the response object and its whole conversation as chat messages (the input of
every earlier turn, this input, this output), so a later turn needs only its one entry.

Each entry belongs to the API key that made it (its place in --api-key's list; None on a
server without keys): get finds it only for that owner, so to any other key it does not exist.

Bounded by entry count and by size: past max_entries, or past max_bytes in all, the least
recently used (stored or read) ended response goes; the one just stored stays, even alone
over max_bytes (it is at most a request body's worth, with its output). A size is estimated
by json_size, linear in the number of values, never in the text, so it costs the event loop
little. A background response still running (queued or in_progress) is held apart, never
evicted, so that its run always finds its entry and GET always finds the run; it joins the
least-recently-used order, as the most recent, when it ends (finish). Each running entry is
an engine request: --max-num-queued-requests bounds them where it is set (without it they
are unbounded, as in vLLM)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyserve.server.openai.responses.background import EventLog

MAX_ENTRIES = 1000
MAX_BYTES = 256 * 1024 * 1024  # --max-stored-response-bytes' default
# what json_size counts for a value that is not a string (a number, a key's quotes and colon,
# a container's brackets): about what it takes as JSON, and more than nothing in memory
_NODE_BYTES = 8


def json_size(value) -> int:
    """About the bytes value (JSON's types) takes as JSON: each string's length, and
    _NODE_BYTES for every other value and container entry. A shared sub-value is counted each
    time it is reached (a chain of turns shares its earlier messages: counted per turn, the
    safe side of a bound)."""
    size, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            size += len(item) + 2
        elif isinstance(item, dict):
            size += _NODE_BYTES * (len(item) + 1)
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            size += _NODE_BYTES * (len(item) + 1)
            pending.extend(item)
        else:
            size += _NODE_BYTES
    return size


@dataclass
class Stored:
    response: dict
    conversation: list[dict]
    events: EventLog | None = None  # a background stream's, for GET ?stream=true
    owner: int | None = None  # the API key that made it (server/auth.py's key_index)
    size: int = 0  # json_size of response and conversation, once ended


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, Stored] = OrderedDict()  # ended responses, LRU first
        self._running: dict[str, Stored] = {}
        self._bytes = 0  # the sizes of _entries' entries

    def __len__(self) -> int:
        return len(self._entries) + len(self._running)

    @property
    def bytes(self) -> int:
        """The estimated size of the ended responses held (json_size)."""
        return self._bytes

    def put(self, response: dict, conversation: list[dict], owner: int | None = None) -> Stored:
        """Stores a response that has ended (completed, incomplete)."""
        return self._keep(response["id"], Stored(response, conversation, owner=owner))

    def put_running(self, response: dict, conversation: list[dict],
                    events: EventLog | None = None, owner: int | None = None) -> Stored:
        """Stores a background response that has not ended; nothing evicts it until finish."""
        entry = self._running[response["id"]] = Stored(response, conversation, events, owner)
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
        self._drop(response_id)  # a response stored again replaces itself
        entry.size = json_size(entry.response) + json_size(entry.conversation)
        self._entries[response_id] = entry
        self._bytes += entry.size
        while len(self._entries) > 1 and (len(self._entries) > self.max_entries
                                          or self._bytes > self.max_bytes):
            self._bytes -= self._entries.popitem(last=False)[1].size
        return entry

    def _drop(self, response_id: str) -> Stored | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def get(self, response_id: str, owner: int | None = None) -> Stored | None:
        """The entry, for its owner only (None for any other key, as for an unknown id)."""
        entry = self._running.get(response_id) or self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        if response_id in self._entries:
            self._entries.move_to_end(response_id)
        return entry

    def is_running(self, response_id: str) -> bool:
        return response_id in self._running

    def delete(self, response_id: str) -> bool:
        return (self._running.pop(response_id, None) or self._drop(response_id)) is not None
