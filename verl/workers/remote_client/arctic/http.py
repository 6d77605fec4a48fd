"""HTTP transport of the Arctic adapter: one ``requests.Session``, time limits, retries, errors.

Every call goes through :meth:`ArcticHttp.request`, which

* reuses pooled keep-alive connections (one ``requests.Session`` per client, ``pool_size`` wide);
* sends ``Authorization: Bearer <token>`` (token from config or ``ARCTIC_RL_TOKEN``; never logged),
  and on every mutating call a fresh ``X-Request-Id`` (uuid4, kept across the call's retries) and,
  when the caller gives it, ``X-Arctic-Step`` (the run's optimizer step, :class:`~.state.RunState`);
* bounds the whole call, retries included, by its operation's time limit (``timeouts.<op>_s``);
* retries transient failures -- connection errors, 429, 502, 503, 504 -- with exponential backoff
  and jitter (``Retry-After`` honoured), logging each retry. A request that may have reached the
  server is retried only when repeating it is harmless: GETs, calls marked idempotent
  (``/forward``, ``/generate``, ...), or any call when the server advertises ``idempotency``
  (it answers a replayed ``X-Request-Id`` from its cache). Against other servers a failed
  ``/forward-backward`` or ``/step`` is never re-sent: a second one would double-count a gradient.
  A connection that was refused never reached the server and is retried for every call;
* maps failures onto the error tree of :mod:`verl.remote_backend.errors` with the endpoint, the
  status and the server's own message (``{"detail": ...}``: a string, ``{message, field, allowed,
  received}`` or FastAPI's list); a 404 for a call that names a job is ``RemoteJobNotFoundError``.
  A mutating call that may have reached the server but got no answer, and may not be re-sent here,
  raises :class:`AmbiguousCallError` (a ``RemoteConnectionError``): whether it was applied is for
  the caller to find out (:mod:`.recovery` reads the server's counters);
* counts what it did in :attr:`ArcticHttp.stats` (retries by reason, replays the server reported), and sums
  each answered call's wall seconds and the server's own (its ``Server-Timing`` header) in
  :attr:`ArcticHttp.call_times`.

Request bodies are passed to ``requests`` as they are: a DSSST1 ``bytearray`` is sent without a copy.
What is not here: body encoding (:mod:`.wire`) and what the calls mean (:mod:`.arctic_rl`).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from urllib3.exceptions import ConnectTimeoutError, MaxRetryError, NewConnectionError

from arctic_rl.protocol import AUTH_HEADER, JSON_MEDIA_TYPE, REPLAY_HEADER, REQUEST_ID_HEADER, STEP_HEADER
from arctic_rl.server_timing import SERVER_TIMING_HEADER, server_seconds
from verl.remote_backend.errors import (
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteServerError,
    RemoteTimeoutError,
)
from verl.remote_backend.timings import CallTimes

from .arctic_config import RetryConfig, TimeoutsConfig

__all__ = ["REPLAY_HEADER", "TOKEN_ENV", "AmbiguousCallError", "ArcticHttp", "new_request_id", "parse_error_detail",
           "resolve_token"]

logger = logging.getLogger(__name__)

TOKEN_ENV = "ARCTIC_RL_TOKEN"
RETRYABLE_STATUS = (429, 502, 503, 504)
#: operation name -> TimeoutsConfig field
OPERATIONS = ("initialize", "forward_backward", "forward", "step", "generate", "weight_sync", "save", "default")


class AmbiguousCallError(RemoteConnectionError):
    """A mutating call may have reached the server, but no answer came and it was not re-sent.

    ``request_id`` is the ``X-Request-Id`` it was sent with (re-sending it to a server that replays
    ids is safe). Picklable like the rest of the error tree.
    """

    def __init__(self, endpoint: str, reason: str, request_id: str | None = None) -> None:
        super().__init__(endpoint, f"sent, but no answer ({reason}); it may or may not have been applied")
        self.request_id = request_id


def new_request_id() -> str:
    """A fresh ``X-Request-Id``."""
    return str(uuid.uuid4())


def resolve_token(configured: str | None) -> str | None:
    """The bearer token: the configured one, else ``$ARCTIC_RL_TOKEN``, else none."""
    return configured or os.environ.get(TOKEN_ENV) or None


def parse_error_detail(resp: requests.Response) -> tuple[str, Any]:
    """``(message, detail)`` of an error answer, in the server's own words."""
    try:
        body = resp.json()
    except ValueError:
        text = (resp.text or "").strip()
        return (text[:1000] or resp.reason or "no message"), None
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, str):
        return detail, detail
    if isinstance(detail, dict):
        parts = [str(detail.get("message") or detail.get("msg") or detail)]
        for key in ("field", "allowed", "received"):
            if detail.get(key) is not None:
                parts.append(f"{key}: {detail[key]!r}" if key == "received" else f"{key}: {detail[key]}")
        return "; ".join(parts), detail
    if isinstance(detail, list):  # FastAPI request validation: [{loc, msg, type}, ...]
        items = []
        for item in detail[:5]:
            if isinstance(item, dict):
                loc = ".".join(str(x) for x in item.get("loc", ()) if x != "body")
                items.append(f"{loc}: {item.get('msg', item)}" if loc else str(item.get("msg", item)))
            else:
                items.append(str(item))
        return "; ".join(items) or "invalid request", detail
    return str(detail), detail


def _never_sent(exc: requests.exceptions.ConnectionError) -> bool:
    """True when the connection could not be opened, so the server never saw the request."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    reason = exc.args[0] if exc.args else None
    if isinstance(reason, MaxRetryError):
        reason = reason.reason
    return isinstance(reason, (NewConnectionError, ConnectTimeoutError))


class ArcticHttp:
    """A pooled, authenticated, retrying HTTP session to one Arctic RL server."""

    def __init__(
        self,
        base_url: str,
        *,
        timeouts: TimeoutsConfig,
        retry: RetryConfig,
        token: str | None = None,
        pool_size: int = 8,
        idempotency: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self.retry = retry
        self._token = resolve_token(token)
        #: the server replays ``X-Request-Id``s (``Features.IDEMPOTENCY``): any call may be retried
        self.idempotency = idempotency
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, max_retries=0)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._sleep = time.sleep  # tests replace it
        #: what this session did: ``retries``, ``retry <endpoint>: <why>``, ``replayed``, ``ambiguous``
        self.stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        #: wall seconds of the calls that got an answer, and the server's own (``Server-Timing``) where sent
        self.call_times = CallTimes()

    def __repr__(self) -> str:  # no token
        return f"ArcticHttp({self.base_url!r}, idempotency={self.idempotency})"

    def close(self) -> None:
        self._session.close()

    def timeout_of(self, op: str) -> float:
        if op not in OPERATIONS:
            raise ValueError(f"operation {op!r}: expected one of {list(OPERATIONS)}")
        return float(getattr(self.timeouts, f"{op}_s"))

    # ------------------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        op: str = "default",
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        data: bytes | bytearray | memoryview | None = None,
        content_type: str | None = None,
        idempotent: bool = False,
        accept_status: tuple[int, ...] = (),
        request_id: str | None = None,
        step: int | None = None,
    ) -> requests.Response:
        """Send one logical call (retrying as the module docstring says); the response is 2xx or in
        ``accept_status``, anything else raises a :class:`~verl.remote_backend.RemoteBackendError`.

        ``request_id``: the ``X-Request-Id`` of a mutating call (default: a fresh one); a caller that
        re-sends a call after :class:`AmbiguousCallError` passes the same id again. ``step``: the
        run's optimizer step, sent as ``X-Arctic-Step`` with a mutating call.
        """
        method = method.upper()
        mutating = method != "GET"
        endpoint = f"{method} {path}" + (f"?{'&'.join(f'{k}={v}' for k, v in params.items())}" if params else "")
        budget = self.timeout_of(op)
        started = time.monotonic()
        deadline = started + budget
        headers: dict[str, str] = {}
        if self._token:
            headers[AUTH_HEADER] = f"Bearer {self._token}"
        if mutating:
            request_id = request_id or new_request_id()
            headers[REQUEST_ID_HEADER] = request_id
            if step is not None:
                headers[STEP_HEADER] = str(int(step))
        if content_type is not None:
            headers["Content-Type"] = content_type
        elif json is not None:
            headers["Content-Type"] = JSON_MEDIA_TYPE
        safe = not mutating or idempotent or self.idempotency
        attempts = self.retry.max_attempts
        maybe_sent = False  # an attempt may have reached the server
        for attempt in range(1, attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RemoteTimeoutError(endpoint, budget, f"time limit spent after {attempt - 1} attempt(s)")
            try:
                resp = self._session.request(
                    method, self.base_url + path, params=params, json=json, data=data, headers=headers,
                    timeout=(min(self.timeouts.connect_s, remaining), remaining),
                )
            except requests.exceptions.ConnectionError as exc:  # includes ConnectTimeout
                never_sent = _never_sent(exc)
                maybe_sent = maybe_sent or not never_sent
                if (safe or never_sent) and self._backoff(endpoint, attempt, deadline, _short(exc)):
                    continue
                raise self._unreachable(endpoint, _short(exc), mutating and maybe_sent, request_id) from None
            except requests.exceptions.Timeout as exc:  # read timeout: the budget is spent
                raise RemoteTimeoutError(endpoint, budget, _short(exc)) from None
            except requests.exceptions.RequestException as exc:  # broken chunked body, ...
                maybe_sent = True
                if safe and self._backoff(endpoint, attempt, deadline, _short(exc)):
                    continue
                raise self._unreachable(endpoint, _short(exc), mutating, request_id) from None
            if resp.headers.get(REPLAY_HEADER):
                self._count("replayed")
                logger.info("%s: the server answered X-Request-Id %s from its replay cache (applied once)",
                            endpoint, request_id)
            if resp.status_code < 400 or resp.status_code in accept_status:
                self.call_times.record(time.monotonic() - started, server_seconds(resp.headers.get(SERVER_TIMING_HEADER)))
                return resp
            if resp.status_code in RETRYABLE_STATUS and safe:
                why = f"HTTP {resp.status_code}: {parse_error_detail(resp)[0]}"
                if self._backoff(endpoint, attempt, deadline, why, retry_after=resp.headers.get("Retry-After")):
                    resp.close()
                    continue
            raise self._error(endpoint, path, params, resp)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _count(self, *keys: str) -> None:
        with self._stats_lock:
            for key in keys:
                self.stats[key] += 1

    def _unreachable(self, endpoint: str, reason: str, ambiguous: bool,
                     request_id: str | None) -> RemoteConnectionError:
        if ambiguous:
            self._count("ambiguous")
            return AmbiguousCallError(endpoint, reason, request_id)
        return RemoteConnectionError(endpoint, reason)

    def _backoff(self, endpoint: str, attempt: int, deadline: float, why: str, *, retry_after: str | None = None) -> bool:
        """Sleep before the next attempt; False when no attempt or time is left (the caller raises)."""
        if attempt >= self.retry.max_attempts:
            return False
        delay = min(self.retry.backoff_max_s, self.retry.backoff_initial_s * 2 ** (attempt - 1))
        delay *= 0.5 + random.random() / 2  # jitter: 50-100% of the exponential delay
        if retry_after:
            try:
                delay = max(delay, min(float(retry_after), self.retry.backoff_max_s))
            except ValueError:  # an HTTP date; keep the computed delay
                pass
        if time.monotonic() + delay >= deadline:
            return False
        logger.warning("%s: attempt %d/%d failed (%s); retrying in %.2f s", endpoint, attempt,
                       self.retry.max_attempts, why, delay)
        self._count("retries", f"retry {endpoint.split('?')[0]}: {why.split(':')[0]}")
        self._sleep(delay)
        return True

    @staticmethod
    def _error(endpoint: str, path: str, params: Mapping[str, Any] | None, resp: requests.Response) -> Exception:
        message, detail = parse_error_detail(resp)
        names_job = bool(params and "job_id" in params) or path.startswith("/job/")
        if resp.status_code == 404 and names_job and detail != "Not Found":  # "Not Found" = no such route
            return RemoteJobNotFoundError(endpoint, 404, message, detail=detail)
        if resp.status_code == 404 and detail == "Not Found":
            message += " (the server does not serve this endpoint: another protocol generation?)"
        return RemoteServerError(endpoint, resp.status_code, message, detail=detail)

    # ------------------------------------------------------------------------------------------

    def probe(self, path: str, timeout_s: float = 5.0) -> Any:
        """``GET path`` once, no retries, no raising: the parsed JSON of a 2xx answer, else ``None``
        (the background health watcher uses it)."""
        headers = {AUTH_HEADER: f"Bearer {self._token}"} if self._token else {}
        try:
            resp = self._session.get(self.base_url + path, headers=headers, timeout=(min(self.timeouts.connect_s,
                                                                                         timeout_s), timeout_s))
            return resp.json() if resp.status_code < 400 else None
        except (requests.exceptions.RequestException, ValueError):
            return None

    def get_json(self, path: str, *, op: str = "default", params: Mapping[str, Any] | None = None) -> Any:
        return self.request("GET", path, op=op, params=params).json()

    def post_json(self, path: str, body: Any = None, *, op: str = "default", params: Mapping[str, Any] | None = None,
                  idempotent: bool = False) -> requests.Response:
        return self.request("POST", path, op=op, params=params, json=body, idempotent=idempotent)


def _short(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text[:300]}"
