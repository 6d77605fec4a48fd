"""Bearer-token authentication of the reference server (optional, ``--token``).

With a token configured every path except ``GET /health`` needs ``Authorization: Bearer <token>``;
the comparison is constant-time (:func:`hmac.compare_digest`). Without a token nothing is checked
-- which is why ``python -m arctic_rl.server`` refuses a non-loopback bind without one.

This is a pure ASGI middleware so that it also guards unknown paths and runs before any body is
read. It is not a user system: one shared secret, no scopes.
"""

from __future__ import annotations

import hmac
import json

from arctic_rl.protocol import Paths

__all__ = ["BearerTokenMiddleware", "token_matches"]

_OPEN_PATHS = frozenset({Paths.HEALTH})


def token_matches(header_value: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` (``Bearer <token>``)."""
    if not header_value:
        return False
    scheme, _, presented = header_value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(presented.strip().encode("utf-8"), token.encode("utf-8"))


class BearerTokenMiddleware:
    """Answers 401 (JSON ``detail``) to any HTTP request but ``/health`` without the token."""

    def __init__(self, app, token: str) -> None:
        if not token:
            raise ValueError("token: expected a non-empty string")
        self.app = app
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        if token_matches(header, self.token):
            await self.app(scope, receive, send)
            return
        message = "missing bearer token" if header is None else "invalid bearer token"
        body = json.dumps(
            {"detail": {"message": message, "field": "Authorization", "allowed": None, "received": None}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
