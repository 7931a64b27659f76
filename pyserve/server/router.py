"""Routes: (method, path) -> handler, with 404 for unknown paths and 405 (and Allow) for a
known path asked with the wrong method. Paths are normalised before lookup, so that
percent-encoding, repeated slashes and a trailing slash name the same route."""

from __future__ import annotations

import posixpath
from urllib.parse import unquote

from pyserve.server.http import Handler, Request, Response


def normalize_path(target: str) -> str:
    """'/v1//models/?x=1', '//v1/models', '/v1/%6Dodels' -> '/v1/models'. (Not urlsplit: it
    would read '//v1/models' as a host name.)"""
    path = unquote(target.split("?", 1)[0].split("#", 1)[0])
    return posixpath.normpath("/" + path.lstrip("/"))


class Router:
    def __init__(self, error_response):
        self._routes: dict[str, dict[str, Handler]] = {}
        self._error = error_response  # (status, message) -> Response

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path, {})[method] = handler
        if method == "GET":
            self._routes[path].setdefault("HEAD", handler)

    def paths(self) -> list[str]:
        return sorted(self._routes)

    async def __call__(self, request: Request) -> Response:
        path = normalize_path(request.target)
        methods = self._routes.get(path)
        if methods is None:
            return self._error(404, f"no route for {path}")
        handler = methods.get(request.method)
        if handler is None:
            response = self._error(405, f"{request.method} is not allowed on {path}")
            response.headers.append(("allow", ", ".join(sorted(methods))))
            return response
        return await handler(request)
