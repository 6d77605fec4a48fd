"""The remote-backend error tree.

Every error a remote backend raises on the client side derives from :class:`RemoteBackendError`::

    RemoteBackendError
    ├── RemoteBackendConfigError   bad configuration or batch (field, allowed values, received)
    ├── RemoteServerError          the server answered with an error status (endpoint, status, message)
    │   └── RemoteJobNotFoundError     ... 404 for a job id: the server lost its jobs (restart?)
    ├── RemoteConnectionError      the server could not be reached (refused, reset, DNS)
    ├── RemoteTimeoutError         no answer within the operation's time limit
    └── RemoteProtocolError        the answer does not follow the protocol (wire format, fields)

Ray ships exceptions between processes by pickling them, so every class here keeps its
constructor arguments in ``args``-compatible form and round-trips through ``pickle`` intact
(tested). Messages are complete on their own: they name the endpoint, the field, what was
allowed and what was received.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "RemoteBackendConfigError",
    "RemoteBackendError",
    "RemoteConnectionError",
    "RemoteJobNotFoundError",
    "RemoteProtocolError",
    "RemoteServerError",
    "RemoteTimeoutError",
]

_MISSING = object()


class RemoteBackendError(Exception):
    """Base class of every remote-backend error."""

    def __reduce__(self):  # keep keyword-only state across pickling (Ray)
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


def _rebuild(cls: type, state: dict[str, Any], args: tuple) -> RemoteBackendError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class RemoteBackendConfigError(RemoteBackendError, ValueError):
    """A configuration value or a batch is not acceptable.

    ``field`` is the dotted config key (``remote_backend.server.url``) or batch key, ``allowed``
    what would be accepted, ``received`` what was given.
    """

    def __init__(self, field: str, message: str, *, allowed: Any = _MISSING, received: Any = _MISSING):
        self.field = field
        self.allowed = None if allowed is _MISSING else allowed
        self.received = None if received is _MISSING else received
        parts = [f"{field}: {message}"]
        if allowed is not _MISSING:
            parts.append(f"allowed: {allowed}")
        if received is not _MISSING:
            parts.append(f"received: {received!r}")
        super().__init__("; ".join(parts))


class RemoteServerError(RemoteBackendError):
    """The server answered ``status`` (4xx/5xx) to ``endpoint``, saying ``server_message``."""

    def __init__(self, endpoint: str, status: int, server_message: str, *, detail: Any = None):
        self.endpoint = endpoint
        self.status = int(status)
        self.server_message = server_message
        self.detail = detail
        super().__init__(f"{endpoint} -> HTTP {self.status}: {server_message}")

    @property
    def retryable(self) -> bool:
        """429 and 502/503/504 are transient; everything else is an answer."""
        return self.status in (429, 502, 503, 504)


class RemoteJobNotFoundError(RemoteServerError):
    """404 for a job id: the server does not know the job (it restarted, or it was destroyed)."""


class RemoteConnectionError(RemoteBackendError, ConnectionError):
    """``endpoint`` could not be reached (connection refused/reset, name resolution)."""

    def __init__(self, endpoint: str, reason: str):
        self.endpoint = endpoint
        self.reason = reason
        super().__init__(f"{endpoint}: cannot reach the server: {reason}")


class RemoteTimeoutError(RemoteBackendError, TimeoutError):
    """``endpoint`` gave no answer within ``timeout_s`` seconds."""

    def __init__(self, endpoint: str, timeout_s: float, reason: str = ""):
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.reason = reason
        extra = f" ({reason})" if reason else ""
        super().__init__(f"{endpoint}: no answer within {self.timeout_s:g} s{extra}")


class RemoteProtocolError(RemoteBackendError):
    """The answer of ``endpoint`` does not follow the protocol (wire format, missing fields)."""

    def __init__(self, endpoint: str, message: str):
        self.endpoint = endpoint
        super().__init__(f"{endpoint}: protocol error: {message}")
