"""Which requests run this step, and how many tokens each.

The rule, stated once: there are no prefill and decode phases. Each request's
num_computed_tokens catches up with its num_tokens under a per-step token budget
(max_num_batched_tokens). Running requests go first (a decode needs one token, an unfinished
prompt gets the next chunk), then waiting requests are admitted while the budget, max_num_seqs
and free blocks allow. This one mechanism gives continuous batching and chunked prefill.

A waiting request is admitted with whatever leading full blocks the prefix cache already
holds (num_computed_tokens starts past them). One whose next prompt block is being computed
right now by a running request waits a step instead, and then finds it cached: a burst of
requests sharing a long prefix computes it once, not once per request.

When a running request cannot get the blocks its tokens need, the lowest-priority request
(largest (priority, arrival) key) is preempted: its blocks are freed and it waits again with
its output so far, to be recomputed later. Nothing new is admitted in a step that preempted.
Every path out of RUNNING goes through _release, which frees blocks exactly once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pyserve.config import SchedulerConfig
from pyserve.engine.request import Request, RequestStatus
from pyserve.kv.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The step computes the request's last known token, so it yields the next one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by _key
        self.running: list[Request] = []
        self.num_preemptions = 0

    def _key(self, request: Request) -> tuple[int, int]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival)

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, request.num_computed_tokens + n):
                victim = max(self.running, key=self._key)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                # Under the priority policy the victim may already be scheduled this step.
                for s in scheduled:
                    if s.request is victim:
                        scheduled.remove(s)
                        budget += s.num_new_tokens
                        break
            else:
                scheduled.append(ScheduledRequest(request, n))
                budget -= n
            i = self._index_after(request)

        i = 0
        while (not preempted and i < len(self.waiting) and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[i]
            if self.kv.prefix_in_flight(request):
                i += 1  # let the request that computes the shared prefix finish it
                continue
            n = self.kv.allocate_new_request(request, budget)
            if n is None:
                break
            self.waiting.pop(i)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, n))
            budget -= n
        return scheduled

    def _index_after(self, request: Request) -> int:
        try:
            return self.running.index(request) + 1
        except ValueError:  # it was preempted
            return len(self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def finish(self, request: Request) -> None:
        """Takes a finished or aborted request out of the queues and frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
