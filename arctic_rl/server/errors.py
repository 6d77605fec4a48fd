"""HTTP errors of the reference server, and the handlers that turn every failure into JSON.

Hierarchy::

    ApiError                 (400 unless a subclass says otherwise)
     +-- BadRequest          400  malformed or invalid input; names the field
     +-- Unauthorized        401  missing or wrong bearer token
     +-- NotFound            404  unknown job, missing checkpoint
     +-- Conflict            409  a second job of a type, a reused request id with another payload
     +-- RequestTimeout      408  body not received within ``--body-timeout-s``
     +-- PayloadTooLarge     413  body over ``--max-body-mb``

Every 4xx body is ``{"detail": {"message", "field", "allowed", "received"}}``
(:class:`arctic_rl.protocol.ErrorDetail`). Anything unexpected becomes a logged 500 with a JSON
message; the server keeps serving. What is not here: *which* input is invalid (that is
:mod:`arctic_rl.server.http.validation`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "Unauthorized",
    "from_validation_error",
    "install_error_handlers",
]

logger = logging.getLogger("arctic_rl.server")

_MAX_RECEIVED_CHARS = 200


def _short(value: Any) -> Any:
    """Keep echoed values small and JSON-safe."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # NaN/inf: JSON cannot carry them
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 16 and all(isinstance(v, (int, float, str)) for v in value):
        return list(value)
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _MAX_RECEIVED_CHARS else text[:_MAX_RECEIVED_CHARS] + "..."


class ApiError(Exception):
    """An error answered with ``status_code`` and an :class:`~arctic_rl.protocol.ErrorDetail` body."""

    status_code = 400

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        allowed: Any = None,
        received: Any = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.allowed = allowed
        self.received = received
        if status_code is not None:
            self.status_code = status_code

    def detail(self) -> dict[str, Any]:
        return {
            "message": self.message,
            "field": self.field,
            "allowed": _short(self.allowed) if not isinstance(self.allowed, list) else self.allowed,
            "received": _short(self.received),
        }

    def __reduce__(self):  # picklable with its keyword arguments
        return (_rebuild, (type(self), self.message, self.field, self.allowed, self.received, self.status_code))


def _rebuild(cls, message, field, allowed, received, status_code):
    return cls(message, field=field, allowed=allowed, received=received, status_code=status_code)


class BadRequest(ApiError):
    status_code = 400


class Unauthorized(ApiError):
    status_code = 401


class NotFound(ApiError):
    status_code = 404


class Conflict(ApiError):
    status_code = 409


class PayloadTooLarge(ApiError):
    status_code = 413


class RequestTimeout(ApiError):
    status_code = 408


def from_validation_error(exc: ValidationError, *, prefix: str = "") -> BadRequest:
    """A pydantic error as a 400 naming the first offending field (dotted, under ``prefix``)."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "input": None}
    # drop pydantic's union-member tags ("list[str]", "function-after[...]") from the location
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "__root__" and not (isinstance(p, str) and "[" in p))
    field = ".".join(p for p in (prefix, loc) if p) or None
    allowed = (first.get("ctx") or {}).get("expected")
    message = f"{field or 'body'}: {first.get('msg')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return BadRequest(message, field=field, allowed=allowed, received=first.get("input"))


def _json_error(status: int, detail: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail}, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """JSON bodies for every error; unexpected exceptions become a logged 500."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        level = logging.WARNING if exc.status_code != 404 else logging.INFO
        logger.log(level, "%s %s -> %d: %s", request.method, request.url.path, exc.status_code, exc.message)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        if exc.status_code == 408:  # the client is still (slowly) sending: stop reading, free the connection
            headers = {"Connection": "close"}
        return _json_error(exc.status_code, exc.detail(), headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ())]
        field = ".".join(loc[1:] if loc and loc[0] in ("query", "body", "path", "header") else loc) or None
        detail = {
            "message": f"{field or 'request'}: {first.get('msg', 'invalid request')}",
            "field": field,
            "allowed": None,
            "received": _short(first.get("input")),
        }
        logger.warning("%s %s -> 422: %s", request.method, request.url.path, detail["message"])
        return _json_error(422, detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _json_error(exc.status_code, {"message": message, "field": None, "allowed": None, "received": None})

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s -> 500 (unexpected %s)", request.method, request.url.path, type(exc).__name__)
        detail = {
            "message": f"internal server error: {type(exc).__name__}: {_short(str(exc))}",
            "field": None,
            "allowed": None,
            "received": None,
        }
        return _json_error(500, detail)
