"""Routes: (method, path) -> handler, with 404 for unknown paths and 405 (and Allow) for a
known path asked with the wrong method. Paths are normalised before lookup, so that
percent-encoding, repeated slashes and a trailing slash name the same route.

A path may end in one parameter, '/v1/responses/{response_id}': it matches any one last
segment (of the normalised path) under that prefix, an exact route winning, and the handler
finds the segment in request.path_params."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

from pyserve.server.http import Handler, Request, Response


def normalize_path(target: str) -> str:
    """'/v1//models/?x=1', '//v1/models', '/v1/%6Dodels', 'http://host/v1/models' ->
    '/v1/models'. (Not urlsplit: it would read '//v1/models' as a host name.) The API-key check
    and the router both see this form, so no spelling of a path reaches a route unchecked."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in ("http", "https"):  # absolute form (RFC 9112 3.2.2)
        path = "/" + rest.partition("/")[2]
    path = unquote(path)
    return posixpath.normpath("/" + path.lstrip("/"))


class Router:
    def __init__(self, error_response, prepare=None):
        """prepare: an async callable run on every request that found its handler, before it."""
        self._prepare = prepare
        self._routes: dict[str, dict[str, Handler]] = {}
        # '/v1/responses/' -> ('response_id', {method: handler}): one trailing parameter
        self._prefixes: dict[str, tuple[str, dict[str, Handler]]] = {}
        self._error = error_response  # (status, message) -> Response

    def add(self, method: str, path: str, handler: Handler) -> None:
        head, _, last = path.rpartition("/")
        if last.startswith("{") and last.endswith("}"):
            name = last[1:-1]
            if not name.isidentifier() or "{" in head:
                raise ValueError(f"a route may end in one {{name}} parameter, got {path!r}")
            known, methods = self._prefixes.setdefault(head + "/", (name, {}))
            if known != name:
                raise ValueError(f"{path!r}: the parameter under {head}/ is named {known!r}")
        else:
            methods = self._routes.setdefault(path, {})
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def handler(self, method: str, path: str) -> Handler | None:
        """The handler of an exact (method, path) route, or None."""
        return self._routes.get(path, {}).get(method)

    def routes(self) -> list[tuple[str, str]]:
        """Every (method, path) served, for tests that must cover each route."""
        exact = [(method, path) for path, methods in self._routes.items() for method in methods]
        prefixed = [(method, f"{prefix}{{{name}}}") for prefix, (name, methods) in self._prefixes.items()
                    for method in methods]
        return sorted(exact + prefixed)

    async def __call__(self, request: Request) -> Response:
        path = normalize_path(request.target)
        methods = self._routes.get(path)
        if methods is None:
            head, _, last = path.rpartition("/")
            name, methods = self._prefixes.get(head + "/", (None, None))
            if methods is None or not last:
                return self._error(404, f"no route for {path}")
            request.path_params = {name: last}
        handler = methods.get(request.method)
        if handler is None:
            response = self._error(405, f"{request.method} is not allowed on {path}")
            response.headers.append(("allow", ", ".join(sorted(methods))))
            return response
        if self._prepare is not None:
            await self._prepare(request)
        return await handler(request)
