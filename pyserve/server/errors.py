"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}; and in
Anthropic's, {"type": "error", "error": {"type", "message"}}, on its /v1/messages routes."""

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


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_response(status: int, message: str) -> Response:
    return Response(status, orjson.dumps({"type": "error", "error": {
        "type": anthropic_error_type(status), "message": message}}))


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def as_anthropic_error(response: Response) -> Response:
    """An error answered in OpenAI's shape (the router's 404 and 405, a 503 while loading, a
    refusal raised below the route) re-shaped as Anthropic's, headers kept."""
    if not isinstance(response, Response) or response.status < 400:
        return response
    try:
        body = orjson.loads(response.body)
        message = body["error"]["message"] if body.get("type") != "error" else None
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        return response
    if message is None:  # already Anthropic's
        return response
    shaped = anthropic_error_response(response.status, message)
    shaped.headers = response.headers
    return shaped
