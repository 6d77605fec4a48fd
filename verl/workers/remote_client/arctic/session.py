"""How the client's roles reach the run's jobs: :class:`JobCalls`, and the run's tokenizer.

:class:`JobCalls` sends a body to a job of the run's :class:`~.state.RunState` through
:class:`~.recovery.Recovery` in the run's :class:`~.dialect.Dialect`; :class:`ModelTokens` loads the
tokenizer once, when a role first needs it.

What is not here: the bodies (the role modules, from :mod:`arctic_rl.protocol`), HTTP retries
(:mod:`.http`), restart handling (:mod:`.recovery`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from arctic_rl.protocol import OCTET_STREAM, JobType, Paths
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
)

from .dialect import Payload
from .recovery import APPLIED, Recovery
from .state import RunState

__all__ = ["JobCalls", "ModelTokens"]

logger = logging.getLogger(__name__)


class JobCalls:
    """Tensor calls to the run's jobs, through :class:`~.recovery.Recovery` and in the run's dialect."""

    def __init__(self, state: RunState, recovery: Recovery) -> None:
        self.state = state
        self.recovery = recovery

    def training_call(self) -> threading.RLock:
        """Held by calls of the training client: a restore never interleaves with them."""
        self.recovery.become_primary()
        return self.recovery.lock

    def post_tensors(self, path: str, job_type: JobType, body: dict, *, op: str, idempotent: bool,
                     counter: tuple[str, int] | None = None) -> dict:
        """POST a tensor body (encoded by the dialect) to the job of ``job_type``; see :meth:`post`."""
        payload = Payload(content_type=OCTET_STREAM, data=self.state.dialect.encode_tensors(body))
        return self.post(path, job_type, payload, op=op, idempotent=idempotent, counter=counter)

    def post(self, path: str, job_type: JobType, payload: Payload, *, op: str, idempotent: bool,
             counter: tuple[str, int] | None = None) -> dict:
        """POST ``payload`` to the job of ``job_type`` through :class:`~.recovery.Recovery`; a call that is
        not ``idempotent`` (``/forward-backward``) is journalled. The answer decoded by the dialect;
        ``{}`` for a call applied whose answer was lost."""
        state, dialect = self.state, self.state.dialect

        def send(request_id: str):
            job_id = state.job(job_type)
            try:
                return state.http.request("POST", path, op=op, params={"job_id": job_id}, data=payload.data,
                                          json=payload.json, content_type=payload.content_type,
                                          idempotent=idempotent, request_id=request_id)
            except RemoteServerError as exc:
                if path == dialect.forward_path and exc.status == 500 and not isinstance(exc, RemoteJobNotFoundError):
                    self._raise_if_job_gone(f"POST {path}", job_id, exc)
                raise

        resp = self.recovery.call(f"POST {path}", send, safe=idempotent, counter=counter)
        if not idempotent:
            journalled = payload.data if payload.data is not None else payload.json
            self.recovery.journal.record(path, journalled, payload.content_type if payload.data is not None else None,
                                         is_step=False)
        if resp is APPLIED:
            logger.warning("arctic: the metrics of an applied %s are lost (its answer never came)", path)
            return {}
        out = dialect.decode(resp, f"POST {path}")
        if not isinstance(out, dict):
            raise RemoteProtocolError(f"POST {path}", f"expected an object, got {type(out).__name__}")
        return out

    def job_info(self, job_type: JobType) -> dict:
        """``GET /job/{id}`` of the run's job of ``job_type``, surviving a restart like any other call (a
        restore re-reads the new job)."""
        state = self.state
        info = self.recovery.call(f"GET {Paths.JOB}", lambda _id: state.http.get_json(Paths.job(state.job(job_type))),
                                  safe=True)
        return info if isinstance(info, dict) else {}

    def _raise_if_job_gone(self, endpoint: str, job_id: int, exc: RemoteServerError) -> None:
        """The vendor's ``/forward`` (v1: ``/fwd-no-grad``) indexes its job table before checking the id: an
        unknown job is a plain 500 there. ``GET /job/{id}`` tells: a 404 makes it :class:`RemoteJobNotFoundError`."""
        try:
            self.state.http.request("GET", Paths.job(job_id), op="default")
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
