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
``/generate``, weight sync, save, load) are simply re-sent, with the same id.

**A restarted server** (:mod:`.restart` says so from the server's evidence). The *training client*
(the one that called the training job: verl's forwarder worker) restores every job; the others
adopt the restored ones (:mod:`.restore`). A background watcher in the training client notices a
restart even while no call is in flight (:mod:`.watcher`). Recovery checkpoints bound what a restore
replays: the training role takes them when :mod:`.checkpoint_schedule` says they are due.

What to do after a failed send is one pure function, :func:`decide` (an :class:`Action` from the
facts gathered about the failure); :class:`Recovery` gathers the facts and carries the action out.
A call comes back as a :class:`CallResult`: answered, or applied with its answer lost. Recovery owns
the :class:`~.journal.UpdateJournal`: it records every acknowledged update itself, and the roles
anchor it at a checkpoint with :meth:`Recovery.anchor`. Each restore or rebuild bumps
:attr:`Recovery.epoch`: a call started before it re-reads the job ids. What is not here: HTTP retries
of transient failures (:mod:`.http`), what the calls carry (:mod:`.dialect` and the role modules),
job creation (:mod:`.jobs`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import requests

from arctic_rl.protocol import JobType, Paths
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
)

from .arctic_config import RecoveryConfig
from .http import AmbiguousCallError, new_request_id
from .journal import CheckpointRef, UpdateJournal
from .request import JobRequest
from .restart import RestartDetector
from .restore import Restorer
from .settle import Outcome, settle
from .state import RunState
from .watcher import RestartWatcher

__all__ = ["Action", "CallResult", "Recovery", "decide"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S = 0.5
_MAX_RESENDS = 20
_FAILED = (RemoteConnectionError, RemoteJobNotFoundError)


@dataclass(frozen=True)
class CallResult(Generic[T]):
    """What a call came to: ``answered`` (``value`` is the answer), or applied with its answer lost
    (``answered`` false, no value: only a call that is not harmless to repeat, settled as applied by
    the server's counter). A call that was not applied never comes back: it is re-sent or raises."""

    value: T | None = None
    answered: bool = True

    @classmethod
    def lost(cls) -> CallResult[Any]:
        """Applied, its answer lost."""
        return cls(None, answered=False)

    def answer(self, what: str) -> T:
        """The answer; for a call that must have one (harmless calls always do)."""
        if not self.answered:
            raise RemoteProtocolError(what, "the call was applied but its answer was lost")
        return self.value  # type: ignore[return-value]


class Action(enum.Enum):
    """What to do after a send failed (:func:`decide`)."""

    RESEND_SAME = "resend_same"  #: send it again with the same X-Request-Id
    RESEND_NEW = "resend_new"  #: send it again as a new call (a new id): not applied, or the jobs are new
    APPLIED = "applied"  #: it was applied, its answer is lost: do not send it again
    SETTLE = "settle"  #: ask the server's counter first, then decide again with its outcome
    REBUILD = "rebuild"  #: nobody can tell: rebuild the training job, then send it as a new call
    RAISE = "raise"  #: give the failure to the caller


def decide(*, restored: bool, job_gone: bool, ambiguous: bool, safe: bool, replays_ids: bool,
           settled: Outcome | None = None) -> Action:
    """The action after a failed send, from what is known about the failure.

    ``restored``: the jobs were restored or adopted since the call was sent (new jobs). ``job_gone``:
    the same server answered 404 for the call's job (destroyed: the run is ending). ``ambiguous``:
    the call may have reached the server (:class:`~.http.AmbiguousCallError`). ``safe``: repeating it
    is harmless. ``replays_ids``: the server answers a repeated ``X-Request-Id`` from its cache.
    ``settled``: what the server's counter said (:func:`~.settle.settle`), once asked.
    """
    if restored:
        return Action.RESEND_NEW
    if job_gone:
        return Action.RAISE
    if not ambiguous or safe or replays_ids:
        return Action.RESEND_SAME  # it never reached the server, repeating it is harmless, or it is replayed
    if settled is None:
        return Action.SETTLE
    return {Outcome.APPLIED: Action.APPLIED, Outcome.NOT_APPLIED: Action.RESEND_NEW,
            Outcome.UNKNOWN: Action.REBUILD}[settled]


class Recovery:
    """Failure handling of one client (see the module docstring).

    ``job_bodies()`` gives the ``/initialize`` bodies of the run's jobs and ``weight_sync`` is the
    request that pushes the training weights to the sampler. :attr:`lock` serialises the training
    client's calls with restores and rebuilds.
    """

    def __init__(self, state: RunState, config: RecoveryConfig, *, job_bodies: Callable[[], dict[JobType, dict]],
                 weight_sync: JobRequest) -> None:
        self.state = state
        self.config = config
        self.journal = UpdateJournal(max_bytes=int(config.journal_max_mb * 2**20))
        if state.step:  # attached mid-run: what preceded it is unknown to this client
            self.journal.start_unknown(state.step)
        self.stats: Counter[str] = Counter()
        self.lock = threading.RLock()
        self.epoch = 0
        self.primary = False  # this client trains: it restores, the others adopt
        self.detector = RestartDetector(state, wait_s=config.wait_s)
        self.restorer = Restorer(state, config, self.journal, self.detector, self.stats, job_bodies=job_bodies,
                                 weight_sync=weight_sync)
        self._watcher: RestartWatcher | None = None

    def training_call(self) -> threading.RLock:
        """Held by the training client's calls (a restore never interleaves with them); the first one
        makes this client the one that restores after restarts."""
        self.become_primary()
        return self.lock

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

    # ------------------------------------------------------------------------------ journal

    def anchor(self, path: str, step: int, *, saved: bool = False) -> None:
        """A checkpoint at ``path`` of optimizer step ``step`` was saved or loaded: a restore starts from it. A save
        keeps the journal's entries before it until the next weight sync (:meth:`sampler_synced`)."""
        self.journal.reset(CheckpointRef(str(path), int(step)), keep_previous=saved)

    def sampler_synced(self) -> None:
        """The sampler now has the training job's weights of the current step (a weight sync was answered)."""
        self.state.sampler_step = self.state.step
        self.journal.drop_previous()

    def _acknowledged(self, request: JobRequest) -> None:
        """An update the server applied (answered, or settled as applied) goes into the journal."""
        if request.idempotent:
            return
        body = request.payload
        self.journal.record(request.path, body.data if body.data is not None else body.json,
                            body.content_type if body.data is not None else None, is_step=request.path == Paths.STEP)

    # ------------------------------------------------------------------------------ calls

    def call(self, request: JobRequest, *, counter: tuple[str, int] | None = None) -> CallResult[requests.Response]:
        """Send ``request``, surviving unanswered calls and restarts; an update is journalled once applied.

        ``counter``: ``(name, value before the call)`` of the training job's ``GET /job`` counter that
        the call increments by one (what settles it on a server that does not replay request ids).
        """
        if not self.config.enable:
            resp = request.send(self.state, new_request_id())
            self._acknowledged(request)
            return CallResult(resp)
        request_id = new_request_id()
        deadline = time.monotonic() + self.config.wait_s
        for _ in range(_MAX_RESENDS):
            epoch = self.epoch
            try:
                resp = request.send(self.state, request_id)
                self.detector.down_seen = False
                self._acknowledged(request)
                return CallResult(resp)
            except _FAILED as exc:
                failure = exc
            action = self._after_failure(request, failure, epoch, deadline, counter)
            if action is Action.RAISE:
                raise failure
            if action is Action.APPLIED:
                self._acknowledged(request)
                return CallResult.lost()
            if action is Action.RESEND_NEW:
                request_id = new_request_id()
            if time.monotonic() >= deadline:
                break
        raise RemoteConnectionError(request.what, f"still failing after {_MAX_RESENDS} re-sends / recovery.wait_s = "
                                    f"{self.config.wait_s:g} s")

    def _after_failure(self, request: JobRequest, failure: RemoteBackendError, epoch: int, deadline: float,
                       counter: tuple[str, int] | None) -> Action:
        """The action after ``failure``, carried out as far as it goes before the next send; the
        server failing again meanwhile is waited out (never re-send before this is decided)."""
        while True:
            try:
                return self._decide_and_prepare(request, failure, epoch, deadline, counter)
            except _FAILED as again:  # the server failed again while deciding
                if time.monotonic() >= deadline:
                    raise
                self.detector.down_seen = True
                logger.warning("arctic: %s: deciding after a failure failed too (%s); trying again", request.what,
                               again)
                time.sleep(_POLL_S)

    def _decide_and_prepare(self, request: JobRequest, failure: RemoteBackendError, epoch: int, deadline: float,
                            counter: tuple[str, int] | None) -> Action:
        what = request.what
        facts = {"restored": self._restored_after(failure, epoch, deadline),
                 "job_gone": isinstance(failure, RemoteJobNotFoundError),
                 "ambiguous": isinstance(failure, AmbiguousCallError), "safe": request.idempotent,
                 "replays_ids": self.state.http.idempotency}
        action = decide(**facts)
        if action is Action.SETTLE:
            outcome = settle(self.state.http, self.state.job(JobType.TRAINING), what, counter,
                             wait_s=self.config.wait_s)
            action = decide(**facts, settled=outcome)
            counted = {Action.APPLIED: "ambiguous_applied", Action.RESEND_NEW: "ambiguous_resent"}.get(action)
            if counted is not None:
                self.stats[counted] += 1
        elif action is Action.RESEND_SAME and facts["ambiguous"] and not facts["safe"]:
            self.stats["resent"] += 1
            logger.warning("arctic: %s got no answer (%s); re-sending it with the same X-Request-Id: the server "
                           "replays ids", what, failure.reason)
        if action is Action.REBUILD:
            self._rebuild_training(what)
            return Action.RESEND_NEW
        return action

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
