"""Idempotent replays of mutating calls, keyed by ``X-Request-Id``.

A client that times out and retries a ``/forward-backward`` must not accumulate the gradient
twice. Every mutating call may carry :data:`arctic_rl.protocol.REQUEST_ID_HEADER`; this cache keeps
the last ``capacity`` ids per *scope* (one scope per job, plus ``"server"`` for ``/initialize``
and ``/destroy``) with a hash of the request and the response that was sent:

* same id, same payload hash, original finished -> the original response, nothing re-applied;
* same id while the original is still running  -> waits for it, then answers the same response;
* same id, different payload                   -> :class:`~arctic_rl.server.errors.Conflict` (409);
* a failed original is forgotten (nothing was applied), so a retry runs again.

All bookkeeping happens on the event loop thread, so no lock is needed. This is not a durable
log: a restarted server remembers nothing (clients see a new ``instance_id`` in ``/health``).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from arctic_rl.server.errors import Conflict

__all__ = ["CachedResponse", "IdempotencyCache", "payload_hash"]


@dataclass(frozen=True)
class CachedResponse:
    """What was sent for a request: enough to send it again byte for byte."""

    status_code: int
    body: bytes | memoryview
    media_type: str


def payload_hash(method: str, path: str, query: Iterable[tuple[str, str]], body: bytes | bytearray | memoryview) -> str:
    """SHA-256 over the method, path, sorted query parameters and body."""
    h = hashlib.sha256()
    h.update(method.upper().encode())
    h.update(b"\0")
    h.update(path.encode())
    h.update(b"\0")
    for key, value in sorted(query):
        h.update(f"{key}={value}&".encode())
    h.update(b"\0")
    h.update(body)
    return h.hexdigest()


@dataclass
class _Entry:
    digest: str
    future: asyncio.Future


class IdempotencyCache:
    """The last ``capacity`` request ids of each scope, with their responses."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self._scopes: dict[str, OrderedDict[str, _Entry]] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self._scopes.values())

    async def run(
        self,
        scope: str,
        request_id: str | None,
        digest: str,
        compute: Callable[[], Awaitable[CachedResponse]],
    ) -> tuple[CachedResponse, bool]:
        """``(response, replayed)``: ``compute()`` once per (scope, id); replays get its response."""
        if not request_id:
            return await compute(), False
        entries = self._scopes.setdefault(scope, OrderedDict())
        entry = entries.get(request_id)
        if entry is not None:
            if entry.digest != digest:
                raise Conflict(
                    f"X-Request-Id {request_id!r} was already used with a different payload",
                    field="X-Request-Id",
                    received=request_id,
                )
            entries.move_to_end(request_id)
            return await asyncio.shield(entry.future), True
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        entries[request_id] = _Entry(digest, future)
        try:
            response = await compute()
        except BaseException as exc:
            if entries.get(request_id) is not None and entries[request_id].future is future:
                del entries[request_id]
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else RuntimeError("request cancelled"))
                future.exception()  # mark retrieved: waiters (if any) re-raise it themselves
            raise
        future.set_result(response)
        self._evict(entries)
        return response, False

    def _evict(self, entries: OrderedDict[str, _Entry]) -> None:
        while len(entries) > self.capacity:
            oldest_id, oldest = next(iter(entries.items()))
            if not oldest.future.done():  # never forget a call that is still running
                break
            del entries[oldest_id]

    def drop_scope(self, scope: str) -> None:
        """Forget a scope (its job was destroyed)."""
        self._scopes.pop(scope, None)
