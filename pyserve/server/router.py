"""Routes: (method, path) -> handler, with 404 for unknown paths and 405 (and Allow) for a
known path asked with the wrong method. Paths are normalised before lookup, so that
percent-encoding, repeated slashes and a trailing slash name the same route.

A path may hold one parameter, a whole segment: '/v1/responses/{response_id}' or
'/v1/responses/{response_id}/cancel'. It matches any one non-empty segment (of the normalised
path) in that place, the fixed segments around it as they are; an exact route wins, and where
two parameter routes match, the one whose parameter comes later (the longer fixed head) does.
The handler finds the segment in request.path_params."""

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


def without_root_path(target: str, root_path: str) -> str:
    """A request target with --root-path's prefix taken off its path ('/llm/v1/models?x=1',
    '/llm' -> '/v1/models?x=1'): a proxy that keeps the prefix it routes by reaches the same
    routes as one that strips it, as vLLM's (FastAPI's root_path) do. Other targets are left
    as they are. The result is a normalised path, which every later reading keeps."""
    path = normalize_path(target)
    if not root_path or not (path == root_path or path.startswith(root_path + "/")):
        return target
    query = target.partition("?")[2]
    return (path[len(root_path):] or "/") + ("?" + query if query else "")


class Router:
    def __init__(self, error_response, prepare=None):
        """prepare: an async callable run on every request that found its handler, before it."""
        self._prepare = prepare
        self._routes: dict[str, dict[str, Handler]] = {}
        # '/v1/responses/{}/cancel' -> ('response_id', {method: handler}): one parameter each
        self._templates: dict[str, tuple[str, dict[str, Handler]]] = {}
        self._template_segments: set[int] = set()  # their segment counts: other paths skip the search
        self._error = error_response  # (status, message) -> Response

    def add(self, method: str, path: str, handler: Handler) -> None:
        segments = path.split("/")
        params = [i for i, s in enumerate(segments) if "{" in s or "}" in s]
        if not params:
            methods = self._routes.setdefault(path, {})
        else:
            i, name = params[0], segments[params[0]][1:-1]
            if len(params) > 1 or segments[i] != f"{{{name}}}" or not name.isidentifier():
                raise ValueError(f"a route may hold one parameter, a whole {{name}} segment, got {path!r}")
            template = "/".join(segments[:i] + ["{}"] + segments[i + 1:])
            known, methods = self._templates.setdefault(template, (name, {}))
            self._template_segments.add(len(segments))
            if known != name:
                raise ValueError(f"{path!r}: the parameter of {template} is named {known!r}")
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)

    def handler(self, method: str, path: str) -> Handler | None:
        """The handler of an exact (method, path) route, or None."""
        return self._routes.get(path, {}).get(method)

    def routes(self) -> list[tuple[str, str]]:
        """Every (method, path) served, for tests that must cover each route."""
        exact = [(method, path) for path, methods in self._routes.items() for method in methods]
        templated = [(method, template.replace("{}", f"{{{name}}}"))
                     for template, (name, methods) in self._templates.items() for method in methods]
        return sorted(exact + templated)

    def _match(self, path: str) -> tuple[str, str, dict[str, Handler]] | None:
        """(parameter name, its value, methods) of the parameter route path matches: each
        segment in turn, from the last, stands for the parameter (len(segments) lookups)."""
        segments = path.split("/")
        if len(segments) not in self._template_segments:  # a long hostile path costs one split
            return None
        for i in range(len(segments) - 1, 0, -1):
            if segments[i]:
                found = self._templates.get("/".join(segments[:i] + ["{}"] + segments[i + 1:]))
                if found is not None:
                    return found[0], segments[i], found[1]
        return None

    async def __call__(self, request: Request) -> Response:
        path = normalize_path(request.target)
        methods = self._routes.get(path)
        if methods is None:
            match = self._match(path)
            if match is None:
                return self._error(404, f"no route for {path}")
            name, value, methods = match
            request.path_params = {name: value}
        handler = methods.get(request.method)
        if handler is None:
            response = self._error(405, f"{request.method} is not allowed on {path}")
            response.headers.append(("allow", ", ".join(sorted(methods))))
            return response
        if self._prepare is not None:
            await self._prepare(request)
        return await handler(request)
