"""The API-key check, made before routing so that every route, present or future, is guarded.

Open without a key: the liveness routes a load balancer polls (`/health`, `/ping`, `/version`)
and a real CORS preflight (a browser sends those without credentials). Everything else, an
unknown path included, answers 401 without a valid key, so a client without a key cannot tell
which routes exist. A key comes as `Authorization: Bearer <key>` or, as Anthropic's API takes
it, `x-api-key: <key>`; either one matching is enough. The 401 is in Anthropic's error
shape on its /v1/messages paths, OpenAI's elsewhere.

Each presented token is compared with every configured key as SHA-256 digests of equal length,
each comparison in constant time and all of them made, so neither the length of a key nor which
key matched shows in the timing.

Which key matched (its place in --api-key's list) goes with the request, as its owner: stored
responses are kept to the key that made them (server/openai/responses/store.py).
"""

from __future__ import annotations

import hashlib
import hmac

from pyserve.server.errors import anthropic_error_response, error_response, is_anthropic_path
from pyserve.server.http import Request, Response

OPEN_PATHS = frozenset({"/health", "/ping", "/version"})


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class APIKeyCheck:
    def __init__(self, keys: tuple[str, ...]):
        self._digests = tuple(_digest(key) for key in keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def bearer_token(self, request: Request) -> str | None:
        """The token of a single well-formed `Bearer <token>` header (the scheme in any case),
        else None: another scheme, no scheme, extra spaces, or a repeated header (which the
        parser joins with ", ", so its token holds a space)."""
        value = request.headers.get("authorization")
        if value is None:
            return None
        scheme, sep, token = value.partition(" ")
        if not sep or scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
            return None
        return token

    @staticmethod
    def api_key_header(request: Request) -> str | None:
        """The key of a single `x-api-key` header, else None: empty, or holding a space (a
        repeated header, which the parser joins with ", ")."""
        value = request.headers.get("x-api-key")
        if not value or any(c.isspace() for c in value):
            return None
        return value

    def key_index(self, request: Request) -> int | None:
        """The place in --api-key's list of the key the request presents (the Bearer token's
        before x-api-key's, where both match), None where none matches."""
        tokens = [t for t in (self.bearer_token(request), self.api_key_header(request)) if t is not None]
        found = None
        for token in tokens:
            given = _digest(token)
            for index, digest in enumerate(self._digests):  # no early exit: every key costs the same
                if hmac.compare_digest(given, digest) and found is None:
                    found = index
        return found

    def allows(self, request: Request) -> bool:
        return self.key_index(request) is not None

    def refusal(self, path: str = "") -> Response:
        message = "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        if is_anthropic_path(path):
            response = anthropic_error_response(401, message)
        else:
            response = error_response(401, message)
        response.headers.append(("www-authenticate", "Bearer"))
        return response
