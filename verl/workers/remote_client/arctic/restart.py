"""Telling a restarted server from a dropped connection, by the evidence the server gives.

After a failed call the server either is the same process (the connection dropped, an answer was
lost: the run's jobs are still there) or was restarted (its jobs are gone). Evidence, in order:

* the ``instance_id`` of ``/health`` (servers that have one, ours): another id than the one the jobs
  were made on is a restart, the same id is not;
* otherwise (the vendor's servers) the client's own *live* jobs: after a refused or dropped
  connection, a restart is when every job of the run that this client has not retired answers
  ``GET /job/{id}`` with 404. A job this client destroyed itself -- the training job a rebuild
  replaced, a half-built one it abandoned (:attr:`~.state.RunState.retired`) -- is no evidence.

What is not here: what is done after a restart (:mod:`.restore`).
"""

from __future__ import annotations

import logging
import time

from arctic_rl.protocol import Paths
from verl.remote_backend.errors import RemoteConnectionError, RemoteJobNotFoundError

from .state import RunState

__all__ = ["RestartDetector"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5


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
        if known and now:
            return known != now
        if not (self.down_seen or jobs_gone):
            return False  # nothing failed on the way: the same server
        live = self.state.live_jobs()
        if not live:
            return False  # no job of ours to look for: no evidence either way
        for job_id in live.values():
            try:
                self.state.http.get_json(Paths.job(job_id))
                return False  # one of our jobs is still there: the same server
            except RemoteJobNotFoundError:
                continue
        # every live job is gone: a restart if a connection failed on the way (otherwise the jobs were
        # destroyed on purpose, the run is ending)
        return self.down_seen
