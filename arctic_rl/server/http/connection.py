"""Connection-level time limit of the reference server: a request head must arrive in time.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a connection that
trickles the *head* of a request -- a byte of header every few seconds keeps it open forever
(slow-loris), and each such connection counts against ``limit_concurrency``. The protocol class
made by :func:`head_timeout_protocol` is uvicorn's own h11 protocol plus one timer: armed when a
connection opens and after every response, it closes the connection if no complete request head
arrived within ``head_timeout_s`` seconds. Bodies are bounded separately (``--body-timeout-s``,
:func:`arctic_rl.server.http.bodies.read_body`).

What is not here: authentication, body limits, request validation.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["head_timeout_protocol"]

logger = logging.getLogger("arctic_rl.server")


def head_timeout_protocol(head_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request head is not complete in time."""
    if not head_timeout_s > 0:
        raise ValueError(f"head_timeout_s: expected > 0 seconds, got {head_timeout_s}")

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()  # the next request's head has the same time limit

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return  # a request is under way (its body has its own limit) or the connection is gone
            if self.conn.trailing_data[0]:  # bytes of an unfinished head: a slow or stalled client
                logger.warning("closing a connection from %s: no complete request head within %g s",
                               f"{self.client[0]}:{self.client[1]}" if self.client else "?", head_timeout_s)
            self.transport.close()

    return HeadTimeoutH11Protocol
