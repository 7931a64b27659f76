"""CORS: which browser origins may call the API, and answers to preflight requests."""

from __future__ import annotations

from pyserve.config import ServerConfig
from pyserve.server.http import Request, Response


class CORS:
    def __init__(self, config: ServerConfig):
        self.origins = config.allowed_origins
        self.methods = config.allowed_methods
        self.headers = config.allowed_headers
        self.credentials = config.allow_credentials

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin in self.origins

    @staticmethod
    def is_preflight(request: Request) -> bool:
        return (request.method == "OPTIONS" and "origin" in request.headers
                and "access-control-request-method" in request.headers)

    def preflight(self, request: Request) -> Response:
        origin = request.headers["origin"]
        method = request.headers["access-control-request-method"]
        if not self._origin_allowed(origin) or ("*" not in self.methods and method not in self.methods):
            return Response(400, b"Disallowed CORS request", content_type="text/plain")
        asked = request.headers.get("access-control-request-headers", "")
        headers = [("access-control-allow-methods",
                    ", ".join(self.methods) if "*" not in self.methods else
                    "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"),
                   ("access-control-allow-headers", asked if "*" in self.headers else ", ".join(self.headers)),
                   ("access-control-max-age", "600"), ("vary", "Origin"), *self._allow(origin)]
        return Response(200, b"OK", headers, content_type="text/plain")

    def _allow(self, origin: str) -> list[tuple[str, str]]:
        # With credentials the origin is echoed: browsers refuse '*' with credentials.
        if "*" in self.origins and not self.credentials:
            value = "*"
        else:
            value = origin
        out = [("access-control-allow-origin", value)]
        if self.credentials:
            out.append(("access-control-allow-credentials", "true"))
        return out

    def decorate(self, request: Request, response) -> None:
        origin = request.headers.get("origin")
        if origin is not None and self._origin_allowed(origin):
            response.headers.extend(self._allow(origin))
