"""The API-key check, made before routing so that every route, present or future, is guarded.

Open without a key: the liveness routes a load balancer polls (`/health`, `/ping`, `/version`)
and a real CORS preflight (a browser sends those without credentials). Everything else, an
unknown path included, answers 401 without a valid `Authorization: Bearer <key>`, so a client
without a key cannot tell which routes exist.

The presented token is compared with every configured key as SHA-256 digests of equal length,
each comparison in constant time and all of them made, so neither the length of a key nor which
key matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac

from pyserve.server.errors import error_response
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

    def allows(self, request: Request) -> bool:
        token = self.bearer_token(request)
        if token is None:
            return False
        given = _digest(token)
        matched = False
        for digest in self._digests:  # no early exit: every key costs the same
            matched |= hmac.compare_digest(given, digest)
        return matched

    def refusal(self) -> Response:
        response = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
        response.headers.append(("www-authenticate", "Bearer"))
        return response
