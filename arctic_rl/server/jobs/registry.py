"""The jobs of a running server: ids, types, states and the per-job lock.

One job per type (a second ``/initialize`` of a type is a 409 until the first is destroyed); ids
are integers counting from 1 for the life of the process. A job is reserved (state
``INITIALIZING``) before its engine is built, so concurrent ``/initialize`` calls cannot both
win; it becomes ``RUNNING`` when the engine is ready, and is removed if building fails. Every
compute call on a job holds its :class:`asyncio.Lock`, so calls on one job run one at a time,
in arrival order, while ``/health`` and other jobs stay responsive -- except ``/generate`` on a sampler that
batches continuously, which runs beside the others (``generating`` counts them; see :mod:`.service`).

Jobs live in memory only: a restarted server has none (its ``instance_id`` tells clients so).
What is not here: the engines (:mod:`arctic_rl.server.engines`), HTTP.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arctic_rl.protocol import JobConfig, JobType
from arctic_rl.server.errors import BadRequest, Conflict, NotFound

if TYPE_CHECKING:
    from arctic_rl.server.engines.protocols import Engine

__all__ = ["Job", "JobRegistry", "JobState"]


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


class JobState:
    INITIALIZING = "INITIALIZING"
    RUNNING = "RUNNING"


@dataclass
class Job:
    job_id: int
    job_type: JobType
    config: JobConfig
    job_dir: Path | None = None
    state: str = JobState.INITIALIZING
    engine: Engine | None = None  # built after the job is reserved (arctic_rl.server.engines.protocols)
    created_at: float = field(default_factory=time.time)
    calls: int = 0
    last_call_at: float = field(default_factory=time.time)  # creation, or the end of the latest call
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: ``/generate`` calls in flight on a sampler that batches continuously (they take no lock)
    generating: int = 0
    #: set while the job admits ``/generate`` calls; cleared while its sampler sleeps for another job's building
    #: (:mod:`.setup_hold`): calls that arrive then wait instead of being refused
    admitting: asyncio.Event = field(default_factory=_set_event)
    #: the job accepts calls but warms up before it runs them (:mod:`.background_setup`)
    warming_up: bool = False

    def info(self) -> dict[str, Any]:
        """``GET /job/{id}`` (:class:`arctic_rl.protocol.JobInfo` plus engine details)."""
        worker = self.config.ds_worker_config
        info: dict[str, Any] = {
            "job_id": self.job_id,
            "job_type": self.job_type.value,
            "model_name": self.config.model_name,
            "status": self.state,
            "running": self.state == JobState.RUNNING,
            "warming_up": self.warming_up,
            "checkpoint_path": str(self.job_dir) if self.job_dir is not None else None,
            "created_at": self.created_at,
            "calls": self.calls,
            "client_tag": self.config.client_tag,
            # the sizes the client said it sends (ds_worker_config.batch_shape: the warm-up runs at them too)
            "batch_shape": None if worker is None or worker.batch_shape is None else worker.batch_shape.model_dump(),
            "busy": self.lock.locked() or self.generating > 0,  # a call is computing on the job (or waits for it)
            # seconds since the job last finished a call (or was created); 0 while busy. A client whose
            # driver was SIGKILLed leaves jobs that only grow idle: see remote_backend.server.reclaim_idle_jobs_s
            "idle_s": 0.0 if self.lock.locked() or self.generating > 0 else round(max(0.0, time.time() - self.last_call_at), 3),
        }
        if self.engine is not None:
            info.update(self.engine.info())
        return info


class JobRegistry:
    """The server's jobs (one per type)."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._next_id = 1

    def reserve(self, config: JobConfig, job_dir: Path | None) -> Job:
        for job in self._jobs.values():
            if job.job_type == config.job_type:
                raise Conflict(
                    f"a {config.job_type.value} job already exists (job {job.job_id}); destroy it first",
                    field="job_type",
                    received=config.job_type.value,
                )
        job = Job(self._next_id, config.job_type, config, job_dir)
        self._next_id += 1
        self._jobs[job.job_id] = job
        return job

    def remove(self, job_id: int) -> Job | None:
        return self._jobs.pop(job_id, None)

    def get(self, job_id: int, *types: JobType, running: bool = True) -> Job:
        """The job, checked for type (400) and readiness (409); 404 if unknown."""
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found", field="job_id", allowed=sorted(self._jobs), received=job_id)
        if types and job.job_type not in types:
            wanted = " or ".join(t.value for t in types)
            raise BadRequest(
                f"job {job_id} is a {job.job_type.value} job; this call needs a {wanted} job",
                field="job_id",
                allowed=[t.value for t in types],
                received=job.job_type.value,
            )
        if running and job.state != JobState.RUNNING:
            raise Conflict(f"job {job_id} is {job.state}", field="job_id", received=job_id)
        return job

    def all(self) -> list[Job]:
        return list(self._jobs.values())
