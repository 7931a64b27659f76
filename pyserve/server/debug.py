"""Routes for tests and operators, served only with --enable-debug-endpoints (else 404) and,
like every route, behind --api-key.

GET /debug/books: the engine's books (engine/books.py): requests accepted and how each ended,
and the per-request state left, with every KV block's ref count walked. `balanced` says the
invariants of an idle engine hold; while requests run it is false and `problems` says why."""

from __future__ import annotations

import orjson

from pyserve.engine.books import problems
from pyserve.server.http import Request, Response


def books_handler(engine):
    async def books(request: Request) -> Response:
        figures = engine.books(count_references=True)
        found = problems(figures)
        return Response(200, orjson.dumps({"books": figures, "idle": not engine.has_unfinished(),
                                           "balanced": not found, "problems": found}))
    return books
