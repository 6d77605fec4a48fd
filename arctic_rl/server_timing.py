"""The server's own seconds per call, in the standard ``Server-Timing`` response header.

Every HTTP answer of the reference server carries ``Server-Timing: app;dur=<milliseconds>``: the time from
the moment the request reached the app (before its body was read) to the moment the answer's headers were
sent -- body decoding, validation, the engine's work and encoding the answer. A client that adds up these
durations knows how much of its wall time the server spent; the rest is the network, the client's own work
and waiting. The header is the W3C one (a ``metric;dur=ms`` list), so browsers' and proxies' tools read it too.

Both sides use this module: the reference server installs :class:`ServerTimingMiddleware` (a pure ASGI
middleware: it sees every path, error answers included, and never touches a body), and the client reads the
header with :func:`server_seconds`. A server that sends no such header (the vendor's) leaves the client's
server seconds unknown, never zero.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["SERVER_TIMING_HEADER", "SERVER_TIMING_METRIC", "ServerTimingMiddleware", "server_seconds"]

SERVER_TIMING_HEADER = "Server-Timing"
#: the metric's name within the header
SERVER_TIMING_METRIC = "app"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ServerTimingMiddleware:
    """Adds ``Server-Timing: app;dur=<ms>`` to every HTTP answer."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                millis = (time.perf_counter() - start) * 1000.0
                headers = list(message.get("headers", ()))
                headers.append((b"server-timing", f"{SERVER_TIMING_METRIC};dur={millis:.3f}".encode("latin-1")))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, timed_send)


def server_seconds(header_value: str | None) -> float | None:
    """The seconds of the ``app`` metric in a ``Server-Timing`` header value; None when absent or malformed.

    The header is a comma-separated list of ``name;param=value;...`` entries (W3C Server Timing); other
    metrics and parameters are ignored.
    """
    if not header_value:
        return None
    for entry in header_value.split(","):
        name, _, params = entry.strip().partition(";")
        if name.strip() != SERVER_TIMING_METRIC:
            continue
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "dur":
                try:
                    millis = float(value.strip().strip('"'))
                except ValueError:
                    return None
                return millis / 1000.0 if millis >= 0 else None
    return None
