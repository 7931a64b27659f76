"""The one owner of request state: every admitted group and its completions, by id. An abort
or a finish takes a group out here and nowhere else (the scheduler's queues hold the same
objects and are emptied by Scheduler.finish), so here each request's one terminal event is
counted (engine/books.py)."""

from __future__ import annotations

from pyserve.engine.books import RequestCounts
from pyserve.engine.request import Request
from pyserve.engine.request_group import RequestGroup


class RequestTable:
    def __init__(self):
        self._groups: dict[str, RequestGroup] = {}
        self._children: dict[str, Request] = {}
        self.counts = RequestCounts()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, group: RequestGroup) -> None:
        self._groups[group.request_id] = group
        self.counts.accepted += 1
        for child in group.children:
            self._children[child.request_id] = child

    def group(self, request_id: str) -> RequestGroup | None:
        return self._groups.get(request_id)

    def child(self, request_id: str) -> Request | None:
        """A completion by its own id (a group's id when n is 1)."""
        return self._children.get(request_id)

    def group_of(self, child: Request) -> RequestGroup:
        return self._groups[child.group_id]

    def remove(self, request_id: str, outcome: str) -> RequestGroup | None:
        """Takes the group out by its terminal event (books.OUTCOMES); None if it was gone."""
        group = self._groups.pop(request_id, None)
        if group is not None:
            self.counts.on_ended(outcome)
            for child in group.children:
                self._children.pop(child.request_id, None)
        return group

    def num_children(self) -> int:
        return len(self._children)
