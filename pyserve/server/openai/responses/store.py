"""Stored responses, in memory, for GET / DELETE /v1/responses/{id} and previous_response_id:
each keeps the response object and its whole conversation as chat messages (the input of
every earlier turn, this input, this output), so a later turn needs only its one entry.
Bounded by entry count: past MAX_ENTRIES the least recently used (stored or read) goes."""

from __future__ import annotations

from collections import OrderedDict

MAX_ENTRIES = 1000


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        self._entries[response["id"]] = (response, conversation)
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        """(the response, its conversation), or None."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
