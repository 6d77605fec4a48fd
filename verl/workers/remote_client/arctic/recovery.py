"""Keeping a run going when the Arctic server fails: unanswered calls, restarts, the update journal.

A GRPO run lasts days and its server is across a network. Two things go wrong, and this module
handles both for :class:`~verl.workers.remote_client.arctic.arctic_rl.ArcticRLClient`, on the run's shared
:class:`~.session.RunState`:

**An unanswered mutating call** (:class:`~.http.AmbiguousCallError`: sent, then the connection
died). If the server is still the same process, either it replays ``X-Request-Id``s (it lists
``idempotency``; the call is re-sent with the *same* id and answered from the server's cache, so it
is applied once), or the server's own counters decide (``GET /job/{id}``: ``global_step`` for
``/step``, ``pending_forward_backward`` for ``/forward-backward`` -- one per mini-batch, then
``/step``): one more than before means the call was applied (it is not re-sent), unchanged means it
was not (it is re-sent with a new id). A server that has neither (the vendor's) never gets the call
re-sent onto the same job: its training job is rebuilt from the last checkpoint and the journal
(which holds only acknowledged calls), then the call is sent to the rebuilt job; without a complete
journal the run stops with an error saying the training state is unknown. Harmless calls
(``/forward``, ``/generate``, weight sync, save, load) are simply re-sent.

**A restarted server** (connection refused, then a new ``instance_id`` in ``/health``, or -- from a
server without instance ids -- unknown jobs). The *training client* (the one that called the
training job: verl's forwarder worker) restores: it creates the jobs again, ``/load-checkpoint``s
the last good checkpoint, replays the :class:`UpdateJournal` (every ``/forward-backward`` body and
``/step`` acknowledged since that checkpoint, in order) and pushes the weights to the sampler. The
training job is then exactly where it was when the last acknowledged call returned: no step is
applied twice, only the steps since the checkpoint are recomputed. Other clients (rollout replicas,
the driver) *adopt* the new jobs once they are ready (listed by ``/status``, tagged with this run's
``client_tag`` when the server echoes tags, the sampler synced). A background watcher in the
training client notices a restart even while no call is in flight (while verl generates, say).

Recovery checkpoints are taken here too (:meth:`Recovery.after_step`: every
``recovery.checkpoint_every_n_steps`` steps, or early when the journal overflowed).

What is not here: the journal itself (:mod:`.journal`), HTTP retries of transient failures
(:mod:`.http`), what the calls carry (:mod:`.dialect` and the role modules), job creation (:mod:`.jobs`).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from arctic_rl.protocol import JobType, LoadCheckpointRequest, Paths
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteServerError,
)

from .arctic_config import RecoveryConfig
from .http import AmbiguousCallError, ArcticHttp, new_request_id
from .jobs import JOB_ORDER, create_job, destroy_jobs, status_jobs
from .journal import UpdateJournal

if TYPE_CHECKING:
    from .session import RunState

__all__ = ["APPLIED", "Outcome", "Recovery", "read_counter"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S = 0.5
_MAX_RESENDS = 20


class _Applied:
    """Returned by :meth:`Recovery.call` for a call that was applied but whose answer was lost."""

    def __repr__(self) -> str:
        return "APPLIED"


APPLIED = _Applied()


class Outcome(str, enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    UNKNOWN = "unknown"


# ------------------------------------------------------------------------------------------------ counters


def read_counter(http: ArcticHttp, job_id: int, counter: str) -> tuple[int | None, dict]:
    """``GET /job/{id}``'s integer ``counter`` (``None`` when the server does not expose it)."""
    info = http.get_json(Paths.job(job_id))
    value = info.get(counter) if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        return None, info if isinstance(info, dict) else {}
    return value, info


# ------------------------------------------------------------------------------------------------ recovery


class Recovery:
    """Failure handling of one client (see the module docstring).

    ``state`` is the run's :class:`~.session.RunState`: this object reads and replaces its job ids,
    instance id, step and owned jobs. ``job_bodies()`` gives the ``/initialize`` bodies of the run's
    jobs (to create them again), ``sync_weights()`` pushes the training weights to the sampler, and
    ``checkpoint_path`` is the training job's configured checkpoint directory (where recovery
    checkpoints go when ``recovery.checkpoint_path`` is unset and the server does not say).
    ``lock`` serialises the training client's calls with restores.
    """

    def __init__(self, state: RunState, config: RecoveryConfig, *, job_bodies: Callable[[], dict[JobType, dict]],
                 sync_weights: Callable[[], dict], checkpoint_path: str | None = None) -> None:
        self.state = state
        self.config = config
        self._job_bodies = job_bodies
        self._sync_weights = sync_weights
        self._default_checkpoint_path = checkpoint_path
        self.journal = UpdateJournal(max_bytes=int(config.journal_max_mb * 2**20))
        self.lock = threading.RLock()
        self.epoch = 0  # bumped by every restore/adoption: calls started before it re-read job ids
        self.primary = False  # this client trains: it restores, the others adopt
        self.stats: Counter[str] = Counter()
        self._down_seen = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._checkpoint_dir: str | None = config.checkpoint_path

    @property
    def http(self) -> ArcticHttp:
        return self.state.http

    # ------------------------------------------------------------------------------ roles

    def become_primary(self) -> None:
        """Called on the first training-job call: this client restores after restarts."""
        if self.primary:
            return
        self.primary = True
        if self.config.enable and self.config.watch_interval_s > 0:
            self._watcher = threading.Thread(target=self._watch, name="arctic-restart-watcher", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------------ calls

    def call(self, what: str, send: Callable[[str], T], *, safe: bool, counter: tuple[str, int] | None = None,
             ) -> T | _Applied:
        """``send(request_id)``, surviving unanswered calls and restarts.

        ``safe``: re-sending is harmless. ``counter``: ``(name, value before the call)`` of the
        training job's ``GET /job`` counter that the call increments by one (``global_step`` for
        ``/step``, ``pending_forward_backward`` for ``/forward-backward``). Returns :data:`APPLIED`
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
                self._down_seen = False
                return result
            except (RemoteConnectionError, RemoteJobNotFoundError) as exc:
                failure = exc
            while True:  # decide what to do; never re-send before that is decided
                try:
                    action = self._decide(what, failure, epoch, deadline, safe, counter, request_id)
                    break
                except (RemoteConnectionError, RemoteJobNotFoundError) as again:  # failed again while deciding
                    if time.monotonic() >= deadline:
                        raise
                    self._down_seen = True
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
        if self._handle_failure(failure, epoch, deadline):
            return "new"  # restored or adopted: new jobs, a new call
        if isinstance(failure, RemoteJobNotFoundError):
            return "raise"  # the same server without the job: destroyed (the run is ending)
        if not isinstance(failure, AmbiguousCallError) or safe:
            return "same"  # it never reached the server, or repeating it is harmless
        if self.http.idempotency:  # a server that replays ids applies it once
            self.stats["resent"] += 1
            logger.warning("arctic: %s got no answer (%s); re-sending it with X-Request-Id %s: the server replays "
                           "ids", what, failure.reason, request_id)
            return "same"
        outcome = self._settle(what, counter)
        if outcome is Outcome.APPLIED:
            self.stats["ambiguous_applied"] += 1
            return "applied"
        if outcome is Outcome.NOT_APPLIED:
            self.stats["ambiguous_resent"] += 1
            return "new"
        self._rebuild_training(what)
        return "new"

    def _handle_failure(self, exc: RemoteBackendError, epoch: int, deadline: float) -> bool:
        """After a failed call: True when the jobs were restored or adopted (re-send to the new ones),
        False when the server is the same process with the same jobs."""
        if isinstance(exc, RemoteConnectionError):
            self._down_seen = True
        if self.epoch != epoch:  # another thread restored meanwhile
            return True
        logger.warning("arctic: %s; checking whether the server restarted", exc)
        while True:
            health = self._wait_for_server(deadline)
            if self.epoch != epoch:
                return True
            if not self._restarted(health, jobs_gone=isinstance(exc, RemoteJobNotFoundError)):
                return False  # the same server: a lost answer, or (404) a job destroyed because the run ends
            try:
                self.recover(epoch, f"{exc}")
                return True
            except (RemoteConnectionError, RemoteJobNotFoundError) as again:  # it failed again while restoring
                if time.monotonic() >= deadline:
                    raise
                self._down_seen = True
                logger.warning("arctic: the restore was interrupted (%s); trying again", again)
                time.sleep(_POLL_S)

    def _settle(self, what: str, counter: tuple[str, int] | None) -> Outcome:
        """Was an unanswered training call applied? Read the server's counter."""
        if counter is None:
            return Outcome.UNKNOWN
        name, before = counter
        job = self.state.job(JobType.TRAINING)
        value, info = read_counter(self.http, job, name)
        deadline = time.monotonic() + self.config.wait_s
        while info.get("busy") is True and time.monotonic() < deadline:  # the call may still be computing
            time.sleep(_POLL_S)
            value, info = read_counter(self.http, job, name)
        if value is None:
            outcome = Outcome.UNKNOWN
        elif value == before + 1:
            outcome = Outcome.APPLIED
        elif value == before:
            outcome = Outcome.NOT_APPLIED
        else:
            outcome = Outcome.UNKNOWN
        logger.warning("arctic: %s got no answer and the server does not replay request ids: its %s is %s (was %d "
                       "before the call) -> %s", what, name, value, before,
                       {Outcome.APPLIED: "it was applied; not re-sending",
                        Outcome.NOT_APPLIED: "it was not applied; re-sending",
                        Outcome.UNKNOWN: "cannot tell; rebuilding the training job from the checkpoint and journal"}
                       [outcome])
        return outcome

    # ------------------------------------------------------------------------------ detection

    def _wait_for_server(self, deadline: float) -> dict:
        """``/health`` once the server answers again (until ``deadline``)."""
        first = True
        while True:
            body = self.http.probe(Paths.HEALTH, timeout_s=5.0)
            if isinstance(body, dict):
                return body
            self._down_seen = True
            if first:
                logger.warning("arctic: the server at %s does not answer; waiting up to %.0f s for it to come back",
                               self.http.base_url, max(0.0, deadline - time.monotonic()))
                first = False
            if time.monotonic() >= deadline:
                raise RemoteConnectionError(f"GET {Paths.HEALTH}", f"the server did not come back within "
                                            f"recovery.wait_s = {self.config.wait_s:g} s")
            time.sleep(_POLL_S)

    def _restarted(self, health: dict, *, jobs_gone: bool) -> bool:
        known, now = self.state.instance_id, health.get("instance_id")
        if known and now:
            return known != now
        # a server without instance ids: a restart shows as refused connections, then unknown jobs
        if not (self._down_seen or jobs_gone):
            return False
        try:
            self.http.get_json(Paths.job(self.state.job(JobType.TRAINING if JobType.TRAINING.value in
                                                        self.state.job_ids else JobType.SAMPLING)))
            return False
        except RemoteJobNotFoundError:
            return self._down_seen

    # ------------------------------------------------------------------------------ restore / adopt

    def recover(self, epoch: int, reason: str) -> None:
        """Restore (training client) or adopt (others) the jobs of a restarted server, once per restart."""
        with self.lock:
            if self.epoch != epoch:
                return
            t0 = time.monotonic()
            if self.primary:
                self._restore(reason)
            else:
                self._adopt(reason)
            self.epoch += 1
            self._down_seen = False
            logger.warning("arctic: recovered from a server restart in %.1f s (jobs now %s)", time.monotonic() - t0,
                           self.state.job_ids)

    def _restore(self, reason: str, only_training: bool = False) -> None:
        state, journal = self.state, self.journal
        health = self._wait_for_server(time.monotonic() + self.config.wait_s)
        logger.warning("arctic: restoring the training state (%s): base %s, %d journalled call(s) with %d step(s)%s",
                       reason, journal.base or "a fresh job", len(journal.entries), journal.steps,
                       "" if journal.complete else " -- JOURNAL INCOMPLETE")
        bodies = self._job_bodies()
        types = [JobType.TRAINING] if only_training else [t for t in JOB_ORDER if t.value in state.job_ids]
        created: dict[str, int] = {}
        try:
            for job_type in types:
                created[job_type.value] = create_job(self.http, job_type, bodies[job_type], tag=state.client_tag)
            training = created[JobType.TRAINING.value]
            step = 0
            if journal.base is not None:
                body = LoadCheckpointRequest(path=journal.base.path).model_dump(mode="json", exclude_none=True)
                out = self.http.post_json(Paths.LOAD_CHECKPOINT, body,
                                          params={"job_id": training}, op="save", idempotent=True).json()
                step = int(out.get("global_step", journal.base.step))
                self.stats["checkpoints_loaded"] += 1
            if journal.complete:
                for entry in journal.entries:
                    resp = self.http.request("POST", entry.path, op="step" if entry.is_step else "forward_backward",
                                             params={"job_id": training}, data=entry.body if entry.content_type else
                                             None, json=None if entry.content_type else entry.body,
                                             content_type=entry.content_type)
                    if entry.is_step:
                        got = (resp.json().get("metrics") or {}).get("global_step")
                        step = int(got) if isinstance(got, int) else step + 1
                    self.stats["journal_replayed"] += 1
                if step != state.step:
                    raise RemoteBackendError(f"arctic: restore reached step {step}, but the client is at step "
                                             f"{state.step}; the run cannot continue exactly")
            elif journal.base is None:
                raise RemoteBackendError(
                    "arctic: the server restarted and this client knows no checkpoint of the run and not every update "
                    "since its start: the training state cannot be restored; resume the run from its last checkpoint")
            else:
                lost = state.step - step
                logger.error("arctic: the update journal was incomplete: restored step %d from %s; the %d step(s) "
                             "since are LOST (the server's step counter is now %d, verl's keeps counting)", step,
                             journal.base, lost, step)
                self.stats["steps_lost"] += lost
                state.set_step(step)
                journal.reset(journal.base)
            state.publish_jobs({**state.job_ids, **created}, health.get("instance_id") or state.instance_id,
                               created=created)
            if not only_training:  # a rebuilt training job holds the weights the sampler already has
                self._sync_weights()
        except BaseException:
            destroy_jobs(self.http, created)
            raise
        self.stats["restores"] += 1

    def _rebuild_training(self, what: str) -> None:
        """Same server, but the state of the training job is unknown: rebuild it from the checkpoint."""
        if not (self.primary and self.journal.complete):
            raise RemoteBackendError(
                f"arctic: {what} got no answer, the server neither replays request ids nor exposes a counter to tell "
                "whether it was applied, and this client cannot rebuild the training state (no complete journal): "
                "the run cannot continue exactly; resume it from its last checkpoint")
        with self.lock:
            old = self.state.job(JobType.TRAINING)
            destroy_jobs(self.http, {JobType.TRAINING.value: old})
            self._restore(f"{what} unanswered", only_training=True)
            self.epoch += 1
        self.stats["training_rebuilds"] += 1

    def _adopt(self, reason: str) -> None:
        """Wait for the training client to restore, then use its jobs."""
        state = self.state
        deadline = time.monotonic() + self.config.wait_s
        wanted = [t for t in JOB_ORDER if t.value in state.job_ids]
        logger.warning("arctic: the server restarted (%s); waiting for the training client to restore the jobs", reason)
        while True:
            health = self._wait_for_server(deadline)
            found = self._ready_jobs(wanted)
            if found is not None:
                state.publish_jobs(found, health.get("instance_id") or state.instance_id, created={})
                self.stats["adoptions"] += 1
                return
            if time.monotonic() >= deadline:
                raise RemoteBackendError(
                    f"arctic: the server restarted and no restored jobs ({[t.value for t in wanted]}, tag "
                    f"{state.client_tag}) appeared within recovery.wait_s = {self.config.wait_s:g} s: the client that "
                    "trains restores them (is it alive, with recovery.enable?)")
            time.sleep(_POLL_S * 2)

    def _ready_jobs(self, wanted: list[JobType]) -> dict[str, int] | None:
        try:
            jobs = status_jobs(self.http)
        except (RemoteBackendError, AttributeError):
            return None
        found: dict[str, int] = {}
        for job_type in wanted:
            matches = [
                v for v in jobs
                if v.get("job_type") == job_type.value
                and ("client_tag" not in v or v["client_tag"] == self.state.client_tag)
            ]
            if len(matches) != 1:
                return None
            info = matches[0]
            job_id = info["job_id"]
            if info.get("running") is False or str(info.get("status", "RUNNING")).upper() != "RUNNING":
                return None
            if job_type is JobType.SAMPLING and isinstance(info.get("weight_version"), int) and \
                    info["weight_version"] < 1:
                return None  # created, not yet synced with the restored weights
            found[job_type.value] = job_id
        return found

    def training_job_info(self) -> dict:
        """``GET /job/{id}`` of the training job, surviving a restart like any other call (the server
        may die right after the step that preceded the read; a restore re-reads the new job)."""
        info = self.call(f"GET {Paths.JOB}", lambda _id: self.http.get_json(
            Paths.job(self.state.job(JobType.TRAINING))), safe=True)
        return info if isinstance(info, dict) else {}

    # ------------------------------------------------------------------------------ checkpoints

    def after_step(self, step: int, save: Callable[..., dict]) -> None:
        """After optimizer step ``step``: save a recovery checkpoint when due (every
        ``checkpoint_every_n_steps``, or early after a journal overflow). ``save`` is the client's
        ``save_checkpoint``, which resets the journal to the new checkpoint."""
        cfg = self.config
        due = cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0
        if not cfg.enable or not (due or self.journal.overflowed):
            return
        if self._checkpoint_dir is None:
            base = self.training_job_info().get("checkpoint_path") or self._default_checkpoint_path
            if not base:
                logger.error("arctic: no directory for recovery checkpoints (set remote_backend.recovery."
                             "checkpoint_path); a restart will replay the journal from the start of the run")
                return
            self._checkpoint_dir = f"{str(base).rstrip('/')}/recovery"
        out = save(step=step, path=self._checkpoint_dir, save_total_limit=cfg.checkpoint_keep)
        self.stats["checkpoints_saved"] += 1
        logger.info("arctic: recovery checkpoint of step %d at %s", step, out.get("path"))

    # ------------------------------------------------------------------------------ watcher

    def _watch(self) -> None:
        """Training client only: restore as soon as a restart shows, even with no call in flight."""
        interval = self.config.watch_interval_s
        while not self._stop.wait(interval):
            if self.state.destroyed:
                return
            epoch = self.epoch
            health = self.http.probe(Paths.HEALTH, timeout_s=min(5.0, interval * 2))
            if not isinstance(health, dict):
                self._down_seen = True
                continue
            try:
                if self._restarted(health, jobs_gone=False):
                    logger.warning("arctic: watcher: the server at %s restarted (instance %s)", self.http.base_url,
                                   health.get("instance_id"))
                    self.recover(epoch, "seen by the watcher")
            except RemoteServerError as exc:
                logger.warning("arctic: watcher: %s", exc)
            except Exception:  # the watcher must not die; the next call retries the restore
                logger.exception("arctic: watcher: restore failed; the next call will try again")
