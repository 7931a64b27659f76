"""The engine's books: what every accepted request became, and what per-request state is left.

Invariants (the books balance):
  * a request (a group: one client request, its n completions) enters the RequestTable once
    when accepted and leaves it once, by its one terminal event: finished (stop, length, ...),
    aborted (the client left, or an abort) or errored (its step failed, the engine died). So
    accepted == finished + aborted + errored + the groups in the table, at every instant;
  * once the engine is idle: nothing running or waiting, the table empty, no stream open, the
    KV manager tracking no request, no KV block referenced (a block is free, or cached for the
    prefix cache with ref count 0), and the runner holding state (seeded generators) only for
    requests whose end it has not been told of yet (it hears at the next step).

`engine_books` reads these figures from an EngineCore; `problems` says which invariant of an
idle engine fails (empty: balanced). /metrics exposes the counters and sizes, GET /debug/books
(with --enable-debug-endpoints) the whole of it."""

from __future__ import annotations

OUTCOMES = ("finished", "aborted", "errored")


class RequestCounts:
    """Accepted requests and their terminal events, counted where the table adds and removes."""

    def __init__(self):
        self.accepted = 0
        self.ended = dict.fromkeys(OUTCOMES, 0)

    def on_ended(self, outcome: str) -> None:
        if outcome not in self.ended:
            raise ValueError(f"unknown terminal event {outcome!r}; one of {OUTCOMES}")
        self.ended[outcome] += 1


def engine_books(core, count_references: bool = False) -> dict:
    """The books of an EngineCore. count_references: also walk every KV block's ref count
    (O(blocks), for the debug route) to cross-check the pool's free count, and count the KV
    pool's resident pages."""
    pool, counts = core.kv.pool, core.requests.counts
    books = {
        "requests_accepted": counts.accepted,
        **{f"requests_{outcome}": n for outcome, n in counts.ended.items()},
        "requests_in_table": len(core.requests),
        "completions_in_table": core.requests.num_children(),
        "num_running": len(core.scheduler.running),
        "num_waiting": len(core.scheduler.waiting),
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_referenced": pool.num_blocks - pool.num_free,
        "kv_blocks_cached": pool.num_cached,
        # blocks ever handed out: the KV pool's memory written so far, which a resident-order
        # pool grows (to its high-water mark of blocks held at once) without leaking
        "kv_blocks_touched": pool.num_touched,
        "kv_bytes_per_block": core.kv_bytes_per_block,
        "kv_manager_requests": core.kv.num_tracked_requests(),
        "runner_requests": core.executor.runner.num_tracked_requests,
        "runner_ends_pending": core.scheduler.num_finished_pending,
    }
    state = core.kv.state
    if state is not None:  # linear-attention layers' state rows (kv/state.py)
        books["state_slots_total"] = state.num_slots
        books["state_slots_referenced"] = state.num_slots - state.num_free_slots
        books["state_checkpoints_kept"] = state.num_checkpoints_kept
        books["state_checkpoints_held"] = state.num_checkpoints_held
    if count_references:
        books["kv_blocks_with_references"] = sum(
            1 for block in range(pool.num_blocks) if pool.ref_count(block) > 0)
        # the pool's pages resident in this process (mincore; None on a GPU): with
        # kv_blocks_touched, what a soak subtracts from the RSS to see what else grows
        books["kv_pool_resident_bytes"] = core.executor.runner.kv_resident_bytes()
    return books


def problems(books: dict) -> list[str]:
    """What keeps an idle engine's books from balancing: one line each; empty when they do."""
    out = []
    ended = sum(books[f"requests_{outcome}"] for outcome in OUTCOMES)
    if books["requests_accepted"] != ended + books["requests_in_table"]:
        out.append(f"{books['requests_accepted']} requests accepted, but {ended} ended and "
                   f"{books['requests_in_table']} still in the table")
    for key in ("requests_in_table", "completions_in_table", "num_running", "num_waiting",
                "kv_blocks_referenced", "kv_manager_requests", "streams_open",
                "state_slots_referenced", "state_checkpoints_held"):
        if books.get(key, 0):
            out.append(f"{key} is {books[key]}, not 0")
    if books.get("kv_blocks_with_references", 0):
        out.append(f"{books['kv_blocks_with_references']} KV blocks have a ref count above 0")
    if books["runner_requests"] > books["runner_ends_pending"]:
        out.append(f"the runner holds state for {books['runner_requests']} requests, "
                   f"{books['runner_ends_pending']} of them ended")
    return out
