"""The restart watcher: a background thread of the training client.

verl spends long stretches generating, when the training client calls no job; a server restarted
then would be noticed only by the next training call, after the sampler already failed. The watcher
probes ``/health`` every ``recovery.watch_interval_s`` and, when the evidence says the server
restarted (:class:`~.restart.RestartDetector`: another instance id, or the run's own live jobs gone
after a failed probe -- never a job this client replaced itself), restores at once.

What is not here: the evidence (:mod:`.restart`), the restore (:mod:`.restore`, through ``recover``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from arctic_rl.protocol import Paths
from verl.remote_backend.errors import RemoteServerError

from .restart import RestartDetector

__all__ = ["RestartWatcher"]

logger = logging.getLogger(__name__)


class RestartWatcher:
    """``recover(epoch, reason)`` restores once per restart (a no-op when ``epoch()`` moved on meanwhile)."""

    def __init__(self, detector: RestartDetector, *, interval_s: float, epoch: Callable[[], int],
                 recover: Callable[[int, str], None]) -> None:
        self.detector = detector
        self.interval_s = interval_s
        self._epoch = epoch
        self._recover = recover
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arctic-restart-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        state, interval = self.detector.state, self.interval_s
        while not self._stop.wait(interval):
            if state.destroyed:
                return
            epoch = self._epoch()
            health = state.http.probe(Paths.HEALTH, timeout_s=min(5.0, interval * 2))
            if not isinstance(health, dict):
                self.detector.down_seen = True
                continue
            try:
                if self.detector.restarted(health, jobs_gone=False):
                    logger.warning("arctic: watcher: the server at %s restarted (%s)", state.http.base_url,
                                   f"instance {health['instance_id']}" if health.get("instance_id")
                                   else "the run's jobs are gone")
                    self._recover(epoch, "seen by the watcher")
            except RemoteServerError as exc:
                logger.warning("arctic: watcher: %s", exc)
            except Exception:  # the watcher must not die; the next call retries the restore
                logger.exception("arctic: watcher: restore failed; the next call will try again")
