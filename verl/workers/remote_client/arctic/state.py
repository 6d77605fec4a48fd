"""The state one Arctic run shares across the client's roles: :class:`RunState`.

It is what a restart can change: the job ids, the server's instance id, the jobs this client owns,
the optimizer step, the step of the sampler's weights -- and the jobs this client *retired* itself (destroyed to replace them, or left
half-built by an interrupted rebuild), which are never taken as evidence that the server restarted.
The client's roles (training, log-probs, generation, checkpoints) and the recovery modules all read
and update this one object, never each other's attributes.

What is not here: how calls reach the jobs (:mod:`.session`), what changes the jobs after a failure
(:mod:`.restore`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from arctic_rl.protocol import JobType
from verl.remote_backend.errors import RemoteBackendError

from .dialect import Dialect
from .http import ArcticHttp

__all__ = ["RunState"]


@dataclass
class RunState:
    """Where the run stands on the server. ``owned``: the jobs this client destroys at the end;
    ``retired``: ids of jobs this client destroyed or abandoned itself."""

    http: ArcticHttp
    dialect: Dialect
    features: frozenset[str]
    job_ids: dict[str, int]
    owned: dict[str, int]
    instance_id: str | None
    client_tag: str | None
    step: int = 0
    #: the optimizer step whose weights the sampler last received (None: no weight sync yet); a restore gives the
    #: sampler that step's weights again, so the version the rollout servers tag samples with stays true
    sampler_step: int | None = None
    destroyed: bool = False
    retired: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def job(self, job_type: JobType) -> int:
        """The id of this run's job of ``job_type``."""
        try:
            return self.job_ids[job_type.value]
        except KeyError:
            raise RemoteBackendError(f"no {job_type.value} job in this backend ({self.job_ids})") from None

    def set_step(self, step: int) -> None:
        """The optimizer step (sent as ``X-Arctic-Step`` with every call to a job, :mod:`.request`)."""
        self.step = int(step)

    def retire(self, job_ids: Iterable[int]) -> None:
        """Jobs this client destroyed or abandoned: their absence says nothing about the server."""
        self.retired.update(int(j) for j in job_ids)

    def live_jobs(self) -> dict[str, int]:
        """The run's jobs that this client has not retired (``{job type: id}``)."""
        return {k: v for k, v in self.job_ids.items() if v not in self.retired}

    def publish_jobs(self, job_ids: dict[str, int], instance_id: str | None, *, created: dict[str, int]) -> None:
        """Switch to restored or adopted jobs; this client owns (destroys) those it ``created``."""
        self.job_ids = dict(job_ids)
        self.instance_id = instance_id
        self.owned.update(created)
        self.retired.difference_update(self.job_ids.values())  # a restarted server may reuse an id
