"""The state one Arctic run shares across the client's roles, and how their calls reach its jobs.

:class:`RunState` is what a restart can change: the job ids, the server's instance id, the jobs this
client owns, the optimizer step. The client's roles (training, log-probs, generation, checkpoints)
and :class:`~.recovery.Recovery` all read and update this one object, never each other's attributes.
:class:`JobCalls` sends a body to a job through :class:`~.recovery.Recovery` in the run's
:class:`~.dialect.Dialect`; :class:`ModelTokens` loads the tokenizer once, when a role first needs it.

What is not here: the bodies (the role modules, from :mod:`arctic_rl.protocol`), HTTP retries
(:mod:`.http`), restart handling (:mod:`.recovery`).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from arctic_rl.protocol import OCTET_STREAM, JobType, Paths
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
)

from .dialect import Dialect, Payload
from .http import ArcticHttp
from .recovery import APPLIED, Recovery

__all__ = ["JobCalls", "ModelTokens", "RunState", "parse_answer"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def parse_answer(model: type[M], value: Any, endpoint: str) -> M:
    """``value`` read with the protocol's (tolerant) response ``model``; a missing or mistyped field is a
    :class:`RemoteProtocolError` naming it, what the model allows and what came."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "(the answer)"
        raise RemoteProtocolError(endpoint, f"{field}: {first.get('msg')} ({model.__name__}); received "
                                  f"{str(first.get('input'))[:200]}") from None


@dataclass
class RunState:
    """Where the run stands on the server. ``owned``: the jobs this client destroys at the end."""

    http: ArcticHttp
    dialect: Dialect
    features: frozenset[str]
    job_ids: dict[str, int]
    owned: dict[str, int]
    instance_id: str | None
    client_tag: str | None
    step: int = 0
    destroyed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.http.step = self.step

    def job(self, job_type: JobType) -> int:
        """The id of this run's job of ``job_type``."""
        try:
            return self.job_ids[job_type.value]
        except KeyError:
            raise RemoteBackendError(f"no {job_type.value} job in this backend ({self.job_ids})") from None

    def set_step(self, step: int) -> None:
        """The optimizer step (also sent as ``X-Arctic-Step`` with every call)."""
        self.step = int(step)
        self.http.step = self.step

    def publish_jobs(self, job_ids: dict[str, int], instance_id: str | None, *, created: dict[str, int]) -> None:
        """Switch to restored or adopted jobs; this client owns (destroys) those it ``created``."""
        self.job_ids = dict(job_ids)
        self.instance_id = instance_id
        self.owned.update(created)


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
