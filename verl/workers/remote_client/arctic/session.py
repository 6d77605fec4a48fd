"""How the client's roles reach the run's jobs: :class:`JobCalls`, and the run's tokenizer.

:class:`JobCalls` is what the roles call: it hands a :class:`~.request.JobRequest` to
:meth:`~.recovery.Recovery.call` (the one call path: the retry rule, the journal of acknowledged
updates) and reads the answer in the run's :class:`~.dialect.Dialect` through its model in
:mod:`arctic_rl.protocol`. Every answer comes back as a :class:`~.recovery.CallResult`: answered, or
applied with its answer lost. :class:`ModelTokens` loads the tokenizer once, when a role first needs it.

What is not here: the bodies (the role modules, from :mod:`arctic_rl.protocol`), HTTP retries
(:mod:`.http`), restart handling (:mod:`.recovery`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

import requests
from pydantic import BaseModel

from arctic_rl.protocol import OCTET_STREAM, JobType
from verl.remote_backend.errors import RemoteProtocolError

from .answers import parse_answer
from .dialect import Payload
from .recovery import CallResult, Recovery
from .request import JobRequest
from .state import RunState

__all__ = ["JobCalls", "ModelTokens"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


class JobCalls:
    """The roles' calls to the run's jobs, through :meth:`~.recovery.Recovery.call` and in the run's
    dialect. ``counter``: ``(name, value before the call)`` of the training job's ``GET /job`` counter
    that a call increments (what settles a lost answer on a server that does not replay request ids)."""

    def __init__(self, state: RunState, recovery: Recovery) -> None:
        self._state = state
        self._recovery = recovery

    def call(self, request: JobRequest, *, counter: tuple[str, int] | None = None) -> CallResult[requests.Response]:
        """Send ``request`` (see :meth:`~.recovery.Recovery.call`)."""
        return self._recovery.call(request, counter=counter)

    def read(self, request: JobRequest, model: type[M], *, counter: tuple[str, int] | None = None) -> CallResult[M]:
        """:meth:`call`, its answer decoded by the dialect and read through the protocol's ``model``."""
        result = self.call(request, counter=counter)
        if not result.answered:
            return CallResult.lost()
        what = request.what
        return CallResult(parse_answer(model, self._state.dialect.decode(result.value, what), what))

    def post_tensors(self, path: str, job_type: JobType, body: dict, *, op: str, idempotent: bool,
                     counter: tuple[str, int] | None = None) -> CallResult[dict]:
        """POST a tensor body (encoded by the dialect) to the job of ``job_type``; see :meth:`post`."""
        payload = Payload(content_type=OCTET_STREAM, data=self._state.dialect.encode_tensors(body))
        return self.post(path, job_type, payload, op=op, idempotent=idempotent, counter=counter)

    def post(self, path: str, job_type: JobType, payload: Payload, *, op: str, idempotent: bool,
             counter: tuple[str, int] | None = None) -> CallResult[dict]:
        """POST ``payload`` to the job of ``job_type``; the answer decoded by the dialect (an object)."""
        request = JobRequest("POST", path, op=op, idempotent=idempotent, job=job_type, payload=payload)
        result = self.call(request, counter=counter)
        if not result.answered:
            logger.warning("arctic: the metrics of an applied %s are lost (its answer never came)", path)
            return CallResult.lost()
        return CallResult(self._object(result.value, request.what))

    def job_info(self, job_type: JobType) -> dict:
        """``GET /job/{id}`` of the run's job of ``job_type`` (after a restore: the new job's)."""
        request = JobRequest.job_info(job_type)
        info = self.call(request).answer(request.what).json()
        return info if isinstance(info, dict) else {}

    def _object(self, resp: requests.Response, what: str) -> dict:
        out = self._state.dialect.decode(resp, what)
        if not isinstance(out, dict):
            raise RemoteProtocolError(what, f"expected an object, got {type(out).__name__}")
        return out


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
