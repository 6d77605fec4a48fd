"""Keeping a run going when the Arctic server fails: one entry point, :meth:`Recovery.call`.

A GRPO run lasts days and its server is across a network. Two things go wrong, and
:class:`Recovery` handles both for :class:`~verl.workers.remote_client.arctic.arctic_rl.ArcticRLClient`,
on the run's shared :class:`~.state.RunState`:

**An unanswered mutating call** (:class:`~.http.AmbiguousCallError`: sent, then the connection
died). If the server is still the same process, either it replays ``X-Request-Id``s (it lists
``idempotency``; the call is re-sent with the *same* id and answered from the server's cache, so it
is applied once), or its counters settle the call (:mod:`.settle`), or -- a server with neither, the
vendor's -- the training job is rebuilt from the last checkpoint and the journal of acknowledged
calls (:mod:`.restore`) and the call goes to the rebuilt job. Harmless calls (``/forward``,
``/generate``, weight sync, save, load) are simply re-sent.

**A restarted server** (:mod:`.restart` says so from the server's evidence). The *training client*
(the one that called the training job: verl's forwarder worker) restores every job; the others
adopt the restored ones (:mod:`.restore`). A background watcher in the training client notices a
restart even while no call is in flight (:mod:`.watcher`). Recovery checkpoints bound what a restore
replays (:mod:`.checkpoint_schedule`).

Each restore or rebuild bumps :attr:`Recovery.epoch`: a call started before it re-reads the job ids.
What is not here: the journal (:mod:`.journal`), HTTP retries of transient failures (:mod:`.http`),
what the calls carry (:mod:`.dialect` and the role modules), job creation (:mod:`.jobs`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from arctic_rl.protocol import JobType
from verl.remote_backend.errors import RemoteBackendError, RemoteConnectionError, RemoteJobNotFoundError

from .arctic_config import RecoveryConfig
from .checkpoint_schedule import CheckpointSchedule
from .http import AmbiguousCallError, new_request_id
from .journal import UpdateJournal
from .restart import RestartDetector
from .restore import Restorer
from .settle import APPLIED, Outcome, settle
from .state import RunState
from .watcher import RestartWatcher

__all__ = ["APPLIED", "Recovery"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S = 0.5
_MAX_RESENDS = 20
_FAILED = (RemoteConnectionError, RemoteJobNotFoundError)


class Recovery:
    """Failure handling of one client (see the module docstring).

    ``job_bodies()`` gives the ``/initialize`` bodies of the run's jobs, ``sync_weights()`` pushes the
    training weights to the sampler, ``job_info()`` reads ``GET /job/{training}``, and
    ``checkpoint_path`` is the training job's configured checkpoint directory. ``lock`` serialises
    the training client's calls with restores and rebuilds.
    """

    def __init__(self, state: RunState, config: RecoveryConfig, *, job_bodies: Callable[[], dict[JobType, dict]],
                 sync_weights: Callable[[], object], job_info: Callable[[], dict],
                 checkpoint_path: str | None = None) -> None:
        self.state = state
        self.config = config
        self.journal = UpdateJournal(max_bytes=int(config.journal_max_mb * 2**20))
        self.stats: Counter[str] = Counter()
        self.lock = threading.RLock()
        self.epoch = 0
        self.primary = False  # this client trains: it restores, the others adopt
        self.detector = RestartDetector(state, wait_s=config.wait_s)
        self.restorer = Restorer(state, config, self.journal, self.detector, self.stats, job_bodies=job_bodies,
                                 sync_weights=sync_weights)
        self.checkpoints = CheckpointSchedule(config, self.journal, self.stats, job_info=job_info,
                                              default_path=checkpoint_path)
        self._watcher: RestartWatcher | None = None

    def become_primary(self) -> None:
        """Called on the first training-job call: this client restores after restarts."""
        if self.primary:
            return
        self.primary = True
        if self.config.enable and self.config.watch_interval_s > 0:
            self._watcher = RestartWatcher(self.detector, interval_s=self.config.watch_interval_s,
                                           epoch=lambda: self.epoch, recover=self.recover)
            self._watcher.start()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def after_step(self, step: int, save: Callable[..., dict]) -> None:
        """After optimizer step ``step``: a recovery checkpoint when due (:mod:`.checkpoint_schedule`)."""
        self.checkpoints.after_step(step, save)

    # ------------------------------------------------------------------------------ calls

    def call(self, what: str, send: Callable[[str], T], *, safe: bool, counter: tuple[str, int] | None = None,
             ) -> T | object:
        """``send(request_id)``, surviving unanswered calls and restarts.

        ``safe``: re-sending is harmless. ``counter``: ``(name, value before the call)`` of the
        training job's ``GET /job`` counter that the call increments by one. Returns :data:`APPLIED`
        when the call was applied but its answer is lost.
        """
        if not self.config.enable:
            return send(new_request_id())
        request_id = new_request_id()
        deadline = time.monotonic() + self.config.wait_s
        for _ in range(_MAX_RESENDS):
            epoch = self.epoch
            try:
                result = send(request_id)
                self.detector.down_seen = False
                return result
            except _FAILED as exc:
                failure = exc
            while True:  # decide what to do; never re-send before that is decided
                try:
                    action = self._decide(what, failure, epoch, deadline, safe, counter, request_id)
                    break
                except _FAILED as again:  # the server failed again while deciding (not while rebuilding)
                    if time.monotonic() >= deadline:
                        raise
                    self.detector.down_seen = True
                    logger.warning("arctic: %s: deciding after a failure failed too (%s); trying again", what, again)
                    time.sleep(_POLL_S)
            if action == "raise":
                raise failure
            if action == "applied":
                return APPLIED
            if action == "new":
                request_id = new_request_id()
            if time.monotonic() >= deadline:
                break
        raise RemoteConnectionError(what, f"still failing after {_MAX_RESENDS} re-sends / recovery.wait_s = "
                                    f"{self.config.wait_s:g} s")

    def _decide(self, what: str, failure: RemoteBackendError, epoch: int, deadline: float, safe: bool,
                counter: tuple[str, int] | None, request_id: str) -> str:
        """After ``failure``: ``"same"`` (re-send with the same id), ``"new"`` (re-send as a new call),
        ``"applied"`` (it was applied; do not re-send) or ``"raise"``."""
        if self._restored_after(failure, epoch, deadline):
            return "new"  # restored or adopted: new jobs, a new call
        if isinstance(failure, RemoteJobNotFoundError):
            return "raise"  # the same server without the job: destroyed (the run is ending)
        if not isinstance(failure, AmbiguousCallError) or safe:
            return "same"  # it never reached the server, or repeating it is harmless
        if self.state.http.idempotency:  # a server that replays ids applies it once
            self.stats["resent"] += 1
            logger.warning("arctic: %s got no answer (%s); re-sending it with X-Request-Id %s: the server replays "
                           "ids", what, failure.reason, request_id)
            return "same"
        outcome = settle(self.state.http, self.state.job(JobType.TRAINING), what, counter, wait_s=self.config.wait_s)
        if outcome is Outcome.APPLIED:
            self.stats["ambiguous_applied"] += 1
            return "applied"
        if outcome is Outcome.NOT_APPLIED:
            self.stats["ambiguous_resent"] += 1
            return "new"
        self._rebuild_training(what)
        return "new"

    def _restored_after(self, failure: RemoteBackendError, epoch: int, deadline: float) -> bool:
        """True when the jobs were restored or adopted since ``epoch`` (re-send to the new ones), False
        when the server is the same process with the same jobs."""
        if isinstance(failure, RemoteConnectionError):
            self.detector.down_seen = True
        if self.epoch != epoch:  # another thread restored meanwhile
            return True
        logger.warning("arctic: %s; checking whether the server restarted", failure)
        health = self.detector.wait_for_server(deadline)
        if self.epoch != epoch:
            return True
        if not self.detector.restarted(health, jobs_gone=isinstance(failure, RemoteJobNotFoundError)):
            return False  # the same server: a lost answer, or (404) a job destroyed because the run ends
        self.recover(epoch, f"{failure}")
        return True

    # ------------------------------------------------------------------------------ restore / rebuild

    def recover(self, epoch: int, reason: str) -> None:
        """Restore (training client) or adopt (others) the jobs of a restarted server, once per restart."""
        with self.lock:
            if self.epoch != epoch:
                return
            t0 = time.monotonic()
            if self.primary:
                self.restorer.restore(reason)
            else:
                self.restorer.adopt(reason)
            self.epoch += 1
            self.detector.down_seen = False
            logger.warning("arctic: recovered from a server restart in %.1f s (jobs now %s)", time.monotonic() - t0,
                           self.state.job_ids)

    def _rebuild_training(self, what: str) -> None:
        """Same server, but the state of the training job is unknown: rebuild it from the checkpoint."""
        if not self.primary:
            raise RemoteBackendError(
                f"arctic: {what} got no answer and only the client that trains can rebuild the training job: the run "
                "cannot continue exactly; resume it from its last checkpoint")
        with self.lock:
            self.restorer.rebuild_training(what)
            self.epoch += 1
