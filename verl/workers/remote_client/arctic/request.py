"""One call to a job of the run, as data: :class:`JobRequest`.

A request names its method, path, time-limit operation and whether repeating it is harmless, plus
*which* job it goes to, as data: ``job`` (sent as ``?job_id=``, or in the path with ``job_in_path``:
``GET /job/{id}``), or ``weight_sync`` (the call that names several jobs: path, query and body built
by the run's dialect). It is addressed afresh at every send, so a re-send after a restore or a rebuild
reaches the new jobs; nothing in a request calls back into the role that made it. :meth:`JobRequest.send` is one
HTTP call (with the transport's retries of transient failures, :mod:`.http`) carrying the run's
optimizer step; the retry rule for lost answers and restarts is applied by
:meth:`~.recovery.Recovery.call`, the one call path of the roles. The restore itself
(:mod:`.restore`) sends requests directly to a job it has not published yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import requests

from arctic_rl.protocol import JobType, Paths
from verl.remote_backend.errors import RemoteBackendError, RemoteJobNotFoundError, RemoteServerError

from .dialect import Payload
from .state import RunState

__all__ = ["JobRequest", "WeightSync"]


@dataclass(frozen=True)
class WeightSync:
    """The weight sync's targets: the run's training job to its sampler, and to its log_prob job when
    ``to_log_prob``; ``cuda_ipc`` and ``low_memory`` as ``remote_backend.weight_sync`` says."""

    to_log_prob: bool
    cuda_ipc: bool
    low_memory: bool


@dataclass(frozen=True)
class JobRequest:
    """See the module docstring. ``op`` picks the time limit (``timeouts.<op>_s``); with ``weight_sync``,
    ``path`` only names the call in logs and errors."""

    method: str
    path: str
    op: str
    idempotent: bool
    job: JobType | None = None
    payload: Payload = field(default_factory=Payload)
    job_in_path: bool = False
    weight_sync: WeightSync | None = None

    @classmethod
    def job_info(cls, job: JobType) -> JobRequest:
        """``GET /job/{id}`` of the run's job of type ``job``."""
        return cls("GET", Paths.JOB, op="default", idempotent=True, job=job, job_in_path=True)

    @property
    def what(self) -> str:
        return f"{self.method} {self.path}"

    def target(self, state: RunState, *, job_id: int | None = None) -> tuple[str, dict | None, Payload]:
        """Path, query and body of the request against ``state``'s jobs (``job_id`` overrides ``job``'s)."""
        if self.weight_sync is not None:
            sync = self.weight_sync
            route = state.dialect.weight_sync(
                training=state.job(JobType.TRAINING), sampling=state.job(JobType.SAMPLING),
                log_prob=state.job(JobType.LOG_PROB) if sync.to_log_prob else None, cuda_ipc=sync.cuda_ipc,
                low_memory=sync.low_memory)
            return route.path, route.params, Payload(json=route.body)
        if job_id is None and self.job is not None:
            job_id = state.job(self.job)
        if self.job_in_path:
            return Paths.job(job_id), None, self.payload
        return self.path, ({"job_id": job_id} if job_id is not None else None), self.payload

    def send(self, state: RunState, request_id: str | None = None, *, job_id: int | None = None) -> requests.Response:
        """One HTTP call (the transport retries only what is harmless to repeat)."""
        path, params, body = self.target(state, job_id=job_id)
        try:
            return state.http.request(self.method, path, op=self.op, params=params, data=body.data, json=body.json,
                                      content_type=body.content_type, idempotent=self.idempotent,
                                      request_id=request_id, step=state.step)
        except RemoteServerError as exc:
            if (self.job is not None and path == state.dialect.forward_path and exc.status == 500
                    and not isinstance(exc, RemoteJobNotFoundError) and params is not None):
                _raise_if_job_gone(state, self.what, int(params["job_id"]), exc)
            raise


def _raise_if_job_gone(state: RunState, endpoint: str, job_id: int, exc: RemoteServerError) -> None:
    """The vendor's ``/forward`` (v1: ``/fwd-no-grad``) indexes its job table before checking the id: an
    unknown job is a plain 500 there. ``GET /job/{id}`` tells: a 404 makes it :class:`RemoteJobNotFoundError`."""
    try:
        state.http.request("GET", Paths.job(job_id))
    except RemoteJobNotFoundError as gone:
        raise RemoteJobNotFoundError(endpoint, 404, f"job {job_id} not found (the server answered HTTP "
                                     f"{exc.status} and GET {Paths.job(job_id)} 404)", detail=gone.detail) from exc
    except RemoteBackendError:
        pass  # the job read failed too: keep the original error
