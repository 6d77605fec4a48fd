"""The Arctic control plane as the adapter uses it: server health, job creation and destruction, handles.

* :func:`read_health` -- ``GET /health`` as :class:`arctic_rl.protocol.HealthResponse` (features,
  instance id; the vendor's server answers ``{"status": "OK"}`` only: no features).
* :func:`create_job` -- ``POST /initialize`` then ``GET /job/{id}`` until ``RUNNING``. A 409 (the
  server already has a job of that type) is re-raised with what to do about it: this adapter never
  destroys jobs that may be in use (the vendor client's start-up clean-up destroys everyone's).
* :func:`destroy_jobs` -- ``POST /destroy`` for the given jobs only; a job already gone is fine.
* :func:`reclaim_abandoned_jobs` -- opt-in (``server.reclaim_idle_jobs_s``): destroy the jobs of an
  earlier run of this adapter that are all idle that long (its driver was SIGKILLed).
* :func:`check_handle` -- validation of a ``reconnect_handle()`` dict received from another process.
* :func:`job_bodies` -- the ``/initialize`` bodies of a run's jobs, tagged (built by :mod:`.builders`).

What is not here: the data plane (:mod:`.arctic_rl`) or HTTP itself (:mod:`.http`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from arctic_rl.protocol import DestroyRequest, HealthResponse, InitializeResponse, JobInfo, JobType, Paths
from verl.remote_backend.errors import (
    RemoteBackendConfigError,
    RemoteBackendError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
    RemoteTimeoutError,
)

from ..common.verl_settings import VerlSettings
from .arctic_config import ArcticConfig
from .builders import build_job_config
from .http import AmbiguousCallError, ArcticHttp

__all__ = ["HANDLE_VERSION", "JOB_ORDER", "check_handle", "create_job", "destroy_jobs", "job_bodies", "read_health",
           "reclaim_abandoned_jobs", "status_jobs", "tagged_jobs"]

logger = logging.getLogger(__name__)

HANDLE_VERSION = 1
#: creation order (the vendor's): the sampler first, the training job last
JOB_ORDER = (JobType.SAMPLING, JobType.LOG_PROB, JobType.TRAINING)
_POLL_S = 0.5


def job_bodies(verl: VerlSettings, arctic: ArcticConfig, tag: str | None,
               features: frozenset[str] = frozenset()) -> dict[JobType, dict]:
    """The ``/initialize`` body of each of the run's jobs, carrying the run's ``client_tag``, for a server with
    ``features`` (its ``/health``)."""
    return {t: build_job_config(t, verl, arctic, client_tag=tag, features=features) for t in JOB_ORDER}


def read_health(http: ArcticHttp) -> HealthResponse:
    body = http.get_json(Paths.HEALTH)
    try:
        return HealthResponse.model_validate(body)
    except ValueError as exc:
        raise RemoteProtocolError(f"GET {Paths.HEALTH}", f"unexpected answer {body!r}: {exc}") from None


def create_job(http: ArcticHttp, job_type: JobType, body: dict, *, tag: str | None = None,
               reclaim_idle_s: float | None = None) -> int:
    """Create one job and wait until it runs; returns its id.

    An ``/initialize`` that got no answer from a server that does not replay request ids is looked
    up in ``/status`` (a job of that type carrying ``tag``) before it is sent again. A 409 (another
    job of that type exists) is retried once after :func:`reclaim_abandoned_jobs` when
    ``reclaim_idle_s`` is set and the blocking run's jobs qualify.
    """
    reclaimed = False
    while True:
        try:
            resp = _initialize(http, job_type, body, tag)
            break
        except RemoteServerError as exc:
            if exc.status != 409:
                raise
            if reclaimed or reclaim_idle_s is None or not reclaim_abandoned_jobs(
                    http, job_type, reclaim_idle_s, own_tag=tag):
                raise _explain_conflict(http, job_type, exc, reclaim_idle_s) from None
            reclaimed = True  # retried once
    try:
        info = InitializeResponse.model_validate(resp.json())
    except ValueError as exc:
        raise RemoteProtocolError(f"POST {Paths.INITIALIZE}", f"unexpected answer: {exc}") from None
    if not info.running:
        _wait_running(http, info.job_id, job_type)
    return info.job_id


def _initialize(http: ArcticHttp, job_type: JobType, body: dict, tag: str | None):
    try:
        return http.post_json(Paths.INITIALIZE, body, op="initialize")
    except AmbiguousCallError as exc:
        found = _find_tagged(http, job_type, tag)
        if found is not None:
            logger.warning("arctic: %s; the server has the %s job %d it created: using it", exc, job_type.value,
                           found)
            return _Existing(found, job_type)
        logger.warning("arctic: %s; no %s job was created: sending /initialize again", exc, job_type.value)
        return http.post_json(Paths.INITIALIZE, body, op="initialize")


class _Existing:
    """Stands in for an ``/initialize`` answer when the job turned out to exist already."""

    def __init__(self, job_id: int, job_type: JobType) -> None:
        self.job_id, self.job_type = job_id, job_type

    def json(self) -> dict:
        return {"job_id": self.job_id, "job_type": self.job_type.value, "running": False}


def _explain_conflict(http: ArcticHttp, job_type: JobType, exc: RemoteServerError,
                      reclaim_idle_s: float | None) -> RemoteServerError:
    hint = ("destroy that job, wait for its run to end, use another server, or set "
            "remote_backend.server.reclaim_idle_jobs_s to let this client destroy jobs that an earlier run of "
            "this adapter abandoned") if reclaim_idle_s is None else (
            f"it is not an abandoned job of this adapter idle for >= {reclaim_idle_s:g} s "
            "(remote_backend.server.reclaim_idle_jobs_s): destroy it, wait for its run to end, or use another server")
    return RemoteServerError(
        exc.endpoint, 409, f"{exc.server_message} -- the server already runs a {job_type.value} job "
        f"({_describe_jobs(http, job_type)}). This client never destroys jobs that may be in use: {hint}",
        detail=exc.detail)


def reclaim_abandoned_jobs(http: ArcticHttp, job_type: JobType, min_idle_s: float, *,
                           own_tag: str | None = None) -> bool:
    """Destroy the run that holds the server's ``job_type`` slot if it was abandoned; True if it was.

    Abandoned means: the blocking job carries a ``client_tag`` (so this adapter created it, for a
    run other than ``own_tag``) and *every* job with that tag reports ``idle_s >= min_idle_s`` and is
    not busy. That is what a run whose driver was SIGKILLed leaves behind (it could not destroy its
    jobs); a live run calls its jobs every step. Jobs without a tag (another client's) and servers
    that report no idle time are never touched.
    """
    try:
        infos = status_jobs(http)
    except (RemoteBackendError, AttributeError):
        return False
    blocking = [v for v in infos if v.get("job_type") == job_type.value]
    tags = {v.get("client_tag") for v in blocking}
    if len(blocking) != 1 or not all(isinstance(t, str) and t for t in tags) or own_tag in tags:
        return False
    tag = tags.pop()
    run = [v for v in infos if v.get("client_tag") == tag]

    def idle(v: dict) -> float:
        value = v.get("idle_s")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else -1.0

    if not all(idle(v) >= min_idle_s and not v.get("busy") for v in run):
        logger.info("arctic: the %s job blocking /initialize belongs to run %s, which is not idle for %g s: "
                    "leaving it alone", job_type.value, tag, min_idle_s)
        return False
    ids = {str(v["job_type"]): int(v["job_id"]) for v in run}
    logger.warning("arctic: destroying the abandoned jobs %s of an earlier run (tag %s, idle %.0f s or more, "
                   "remote_backend.server.reclaim_idle_jobs_s = %g)", ids, tag, min(idle(v) for v in run),
                   min_idle_s)
    destroy_jobs(http, ids)
    return True


def _wait_running(http: ArcticHttp, job_id: int, job_type: JobType) -> None:
    budget = http.timeout_of("initialize")
    deadline = time.monotonic() + budget
    status = "?"
    while time.monotonic() < deadline:
        status = JobInfo.model_validate(http.get_json(Paths.job(job_id))).status.upper()
        if status == "RUNNING":
            return
        if status in ("FAILED", "ERROR", "STOPPED"):
            raise RemoteServerError(f"GET {Paths.job(job_id)}", 500, f"{job_type.value} job {job_id} is {status}")
        time.sleep(_POLL_S)
    raise RemoteTimeoutError(f"GET {Paths.job(job_id)}", budget, f"{job_type.value} job {job_id} still {status}")


def status_jobs(http: ArcticHttp) -> list[dict[str, Any]]:
    """The job infos listed by ``GET /status``, each with its ``job_id`` (the server keys them by id)."""
    jobs = http.get_json(Paths.STATUS).get("jobs", {})
    if not isinstance(jobs, dict):
        return []
    return [dict(v, job_id=int(v.get("job_id", k))) for k, v in jobs.items() if isinstance(v, dict)]


def _find_tagged(http: ArcticHttp, job_type: JobType, tag: str | None) -> int | None:
    """The one job of ``job_type`` in ``/status`` that carries ``tag`` (servers that echo tags only)."""
    if tag is None:
        return None
    ids = [v["job_id"] for v in status_jobs(http) if v.get("job_type") == job_type.value and v.get("client_tag") == tag]
    return ids[0] if len(ids) == 1 else None


def tagged_jobs(http: ArcticHttp, tag: str) -> dict[str, int] | None:
    """``{job type: id}`` of the jobs in ``/status`` carrying ``tag``; ``None`` when the server does not
    echo tags (then nobody can tell whose its jobs are)."""
    infos = status_jobs(http)
    if infos and not any("client_tag" in v for v in infos):
        return None
    return {str(v.get("job_type")): v["job_id"] for v in infos if v.get("client_tag") == tag}


def _describe_jobs(http: ArcticHttp, job_type: JobType) -> str:
    try:
        ids = [str(v["job_id"]) for v in status_jobs(http) if v.get("job_type") == job_type.value]
    except (RemoteBackendError, AttributeError):
        return "see GET /status"
    return f"job id(s) {ids}" if ids else "see GET /status"


def destroy_jobs(http: ArcticHttp, jobs: dict[str, int]) -> None:
    """Destroy exactly ``jobs`` ({job type: id}), the training job first; log (never raise) failures."""
    for job_type in reversed(JOB_ORDER):
        job_id = jobs.get(job_type.value)
        if job_id is None:
            continue
        try:
            body = DestroyRequest(job_type=job_type).model_dump(mode="json")
            http.post_json(Paths.DESTROY, body, params={"job_id": job_id}, idempotent=True)
            logger.info("arctic: destroyed %s job %d", job_type.value, job_id)
        except RemoteJobNotFoundError:
            logger.info("arctic: %s job %d was already gone", job_type.value, job_id)
        except RemoteBackendError as exc:  # keep going: release everything we can
            logger.error("arctic: could not destroy %s job %d: %s", job_type.value, job_id, exc)


def check_handle(handle: Any) -> dict:
    """A validated copy of a ``reconnect_handle()`` dict (job ids as ``{type: int}``)."""
    required = {"url": str, "protocol": int, "job_ids": dict, "step": int}
    if not isinstance(handle, dict):
        raise RemoteBackendConfigError("handle", "expected the dict of ArcticRLClient.reconnect_handle()",
                                       received=type(handle).__name__)
    if handle.get("backend", "arctic") != "arctic" or handle.get("handle_version", HANDLE_VERSION) != HANDLE_VERSION:
        raise RemoteBackendConfigError("handle.handle_version", "not an arctic handle of this version",
                                       allowed={"backend": "arctic", "handle_version": HANDLE_VERSION},
                                       received={k: handle.get(k) for k in ("backend", "handle_version")})
    for key, kind in required.items():
        value = handle.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise RemoteBackendConfigError(f"handle.{key}", "missing or of the wrong type", allowed=kind.__name__,
                                           received=value)
    job_ids = {str(k): int(v) for k, v in handle["job_ids"].items()}
    unknown = sorted(set(job_ids) - {t.value for t in JobType})
    if unknown:
        raise RemoteBackendConfigError("handle.job_ids", "unknown job type", allowed=[t.value for t in JobType],
                                       received=unknown)
    tag = handle.get("client_tag")
    if tag is not None and not isinstance(tag, str):
        raise RemoteBackendConfigError("handle.client_tag", "must be a string or absent", allowed="str", received=tag)
    return {**handle, "job_ids": job_ids, "instance_id": handle.get("instance_id")}
