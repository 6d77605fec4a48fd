"""How the client's roles reach the run's jobs: :class:`JobCalls`, and the run's tokenizer.

:class:`JobCalls` is the one call path of the roles: it sends a :class:`~.request.JobRequest` to a
job of the run's :class:`~.state.RunState` through :class:`~.recovery.Recovery` (its retry rule) in
the run's :class:`~.dialect.Dialect`, journals acknowledged updates, and reads answers through their
models in :mod:`arctic_rl.protocol`. :class:`ModelTokens` loads the tokenizer once, when a role first
needs it.

What is not here: the bodies (the role modules, from :mod:`arctic_rl.protocol`), HTTP retries
(:mod:`.http`), restart handling (:mod:`.recovery`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, TypeVar

import requests
from pydantic import BaseModel

from arctic_rl.protocol import OCTET_STREAM, JobType, Paths
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
)

from .answers import parse_answer
from .dialect import Payload, Route
from .recovery import Recovery
from .request import JobRequest
from .settle import APPLIED
from .state import RunState

__all__ = ["JobCalls", "ModelTokens"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class JobCalls:
    """The one call path of the client's roles: every call to a job, through :class:`~.recovery.Recovery`
    (its retry rule: re-send what is harmless, settle or rebuild what is not, restore after a restart)
    and in the run's dialect. A call that is not ``idempotent`` (``/forward-backward``, ``/step``) is
    journalled once acknowledged (:mod:`.journal`)."""

    def __init__(self, state: RunState, recovery: Recovery) -> None:
        self.state = state
        self.recovery = recovery

    def training_call(self) -> threading.RLock:
        """Held by calls of the training client: a restore never interleaves with them."""
        self.recovery.become_primary()
        return self.recovery.lock

    def call(self, request: JobRequest, *, counter: tuple[str, int] | None = None) -> requests.Response | object:
        """Send ``request``; :data:`~.settle.APPLIED` for a call applied whose answer was lost. ``counter``:
        ``(name, value before the call)`` of the training job's ``GET /job`` counter the call increments."""
        resp = self.recovery.call(request.what, functools.partial(self._send, request), safe=request.idempotent,
                                  counter=counter)
        if not request.idempotent:
            body = request.payload
            self.recovery.journal.record(request.path, body.data if body.data is not None else body.json,
                                         body.content_type if body.data is not None else None,
                                         is_step=request.path == Paths.STEP)
        return resp

    def read(self, request: JobRequest, model: type[M], *, counter: tuple[str, int] | None = None) -> M | None:
        """:meth:`call`, its JSON answer read through the protocol's ``model``; ``None`` when it was
        applied but its answer was lost."""
        resp = self.call(request, counter=counter)
        if resp is APPLIED:
            return None
        return parse_answer(model, self.state.dialect.decode(resp, request.what), request.what)

    def post_tensors(self, path: str, job_type: JobType, body: dict, *, op: str, idempotent: bool,
                     counter: tuple[str, int] | None = None) -> dict:
        """POST a tensor body (encoded by the dialect) to the job of ``job_type``; see :meth:`post`."""
        payload = Payload(content_type=OCTET_STREAM, data=self.state.dialect.encode_tensors(body))
        return self.post(path, job_type, payload, op=op, idempotent=idempotent, counter=counter)

    def post(self, path: str, job_type: JobType, payload: Payload, *, op: str, idempotent: bool,
             counter: tuple[str, int] | None = None) -> dict:
        """POST ``payload`` to the job of ``job_type``; the answer decoded by the dialect, ``{}`` for a
        call applied whose answer was lost."""
        request = JobRequest("POST", path, op=op, idempotent=idempotent, job=job_type, payload=payload)
        resp = self.call(request, counter=counter)
        if resp is APPLIED:
            logger.warning("arctic: the metrics of an applied %s are lost (its answer never came)", path)
            return {}
        out = self.state.dialect.decode(resp, request.what)
        if not isinstance(out, dict):
            raise RemoteProtocolError(request.what, f"expected an object, got {type(out).__name__}")
        return out

    def job_info(self, job_type: JobType) -> dict:
        """``GET /job/{id}`` of the run's job of ``job_type`` (after a restore: the new job's)."""
        request = JobRequest("GET", Paths.JOB, op="default", idempotent=True,
                             route=lambda state: Route(Paths.job(state.job(job_type)), None, None))
        resp = self.call(request)
        info = resp.json() if resp is not APPLIED else None
        return info if isinstance(info, dict) else {}

    def _send(self, request: JobRequest, request_id: str) -> requests.Response:
        try:
            return request.send(self.state, request_id)
        except RemoteServerError as exc:
            if (request.job is not None and request.path == self.state.dialect.forward_path and exc.status == 500
                    and not isinstance(exc, RemoteJobNotFoundError)):
                self._raise_if_job_gone(request.what, self.state.job(request.job), exc)
            raise

    def _raise_if_job_gone(self, endpoint: str, job_id: int, exc: RemoteServerError) -> None:
        """The vendor's ``/forward`` (v1: ``/fwd-no-grad``) indexes its job table before checking the id: an
        unknown job is a plain 500 there. ``GET /job/{id}`` tells: a 404 makes it :class:`RemoteJobNotFoundError`."""
        try:
            JobRequest("GET", Paths.job(job_id), op="default", idempotent=True).send(self.state)
        except RemoteJobNotFoundError as gone:
            raise RemoteJobNotFoundError(endpoint, 404, f"job {job_id} not found (the server answered HTTP "
                                         f"{exc.status} and GET {Paths.job(job_id)} 404)",
                                         detail=gone.detail) from exc
        except RemoteBackendError:
            pass  # the job read failed too: keep the original error


class ModelTokens:
    """The run's tokenizer, loaded on first use (generation decodes prompts; layouts pad with its id)."""

    def __init__(self, tokenizer_path: str, *, trust_remote_code: bool) -> None:
        self.tokenizer_path = tokenizer_path
        self.trust_remote_code = trust_remote_code
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path,
                                                            trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    @functools.cached_property
    def pad_token_id(self) -> int:
        """Fills padded columns (always masked): the tokenizer's pad (or eos) id, else 0."""
        try:
            tok = self.tokenizer
            value = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            return int(value) if value is not None else 0
        except Exception as exc:  # noqa: BLE001 - padding content is masked anyway
            logger.info("arctic: no tokenizer at %s (%s); padding with id 0", self.tokenizer_path, exc)
            return 0
