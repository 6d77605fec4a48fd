"""Telling a restarted server from a dropped connection, by the evidence the server gives.

After a failed call the server either is the same process (the connection dropped, an answer was
lost: the run's jobs are still there) or was restarted (its jobs are gone). Evidence, in order:

* the ``instance_id`` of ``/health`` (servers that have one, ours): another id than the one the jobs
  were made on is a restart, the same id is not;
* otherwise (the vendor's servers) the client's own *live* jobs: after a refused or dropped
  connection, a restart is when every job of the run that this client has not retired answers
  ``GET /job/{id}`` with 404. A job this client destroyed itself -- the training job a rebuild
  replaced, a half-built one it abandoned (:attr:`~.state.RunState.retired`) -- is no evidence.

The rule is a pure function, :func:`judge`; :class:`RestartDetector` gathers its evidence (``/health``,
then, only when the rule asks, ``GET /job/{id}`` of the live jobs). What is not here: what is done after
a restart (:mod:`.restore`).
"""

from __future__ import annotations

import logging
import time

from arctic_rl.protocol import Paths
from verl.remote_backend.errors import RemoteConnectionError, RemoteJobNotFoundError

from .state import RunState

__all__ = ["RestartDetector", "judge"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5


def judge(known: str | None, now: str | None, *, down_seen: bool, jobs_gone: bool, live_jobs: int,
          jobs_found: list[bool] | None = None) -> bool | None:
    """Did the server restart? ``known``/``now``: the instance id the jobs were made on and the one
    ``/health`` gives (``None``: the server has none); ``down_seen``: a connection failed since the last
    good call; ``jobs_gone``: the call was just answered 404 for its job; ``live_jobs``: how many jobs of
    the run this client has not retired; ``jobs_found``: whether ``GET /job/{id}`` found each live job
    looked up. ``None``: look the live jobs up first, then ask again with ``jobs_found``."""
    if known and now:
        return known != now
    if not (down_seen or jobs_gone) or not live_jobs:
        return False  # nothing failed on the way, or no job of ours to look for: the same server
    if jobs_found is None:
        return None
    if any(jobs_found):
        return False  # one of our jobs is still there: the same server
    # every live job is gone: a restart if a connection failed on the way (otherwise the jobs were
    # destroyed on purpose: the run is ending)
    return down_seen


class RestartDetector:
    """Restart evidence for one client. ``down_seen``: a connection failed since the last good call."""

    def __init__(self, state: RunState, *, wait_s: float) -> None:
        self.state = state
        self.wait_s = wait_s
        self.down_seen = False

    def wait_for_server(self, deadline: float) -> dict:
        """``/health`` once the server answers again (until ``deadline``)."""
        http = self.state.http
        first = True
        while True:
            body = http.probe(Paths.HEALTH, timeout_s=5.0)
            if isinstance(body, dict):
                return body
            self.down_seen = True
            if first:
                logger.warning("arctic: the server at %s does not answer; waiting up to %.0f s for it to come back",
                               http.base_url, max(0.0, deadline - time.monotonic()))
                first = False
            if time.monotonic() >= deadline:
                raise RemoteConnectionError(f"GET {Paths.HEALTH}", f"the server did not come back within "
                                            f"recovery.wait_s = {self.wait_s:g} s")
            time.sleep(_POLL_S)

    def restarted(self, health: dict, *, jobs_gone: bool) -> bool:
        """Did the server answering ``health`` restart since the run's jobs were made? ``jobs_gone``: a
        call was just answered 404 for its job."""
        known, now = self.state.instance_id, health.get("instance_id")
        live = self.state.live_jobs()
        facts = {"down_seen": self.down_seen, "jobs_gone": jobs_gone, "live_jobs": len(live)}
        verdict = judge(known, now, **facts)
        if verdict is not None:
            return verdict
        found: list[bool] = []
        for job_id in live.values():
            try:
                self.state.http.get_json(Paths.job(job_id))
                found.append(True)
                break  # one is enough
            except RemoteJobNotFoundError:
                found.append(False)
        return bool(judge(known, now, **facts, jobs_found=found))
