"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from http import HTTPStatus

import orjson

from pyserve.server.http import Response

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 413: "RequestTooLarge", 429: "RateLimitError",
          431: "RequestHeaderFieldsTooLarge", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or []


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}})


def error_response(status: int, message: str, param: str | None = None) -> Response:
    return Response(status, error_body(status, message, param))
