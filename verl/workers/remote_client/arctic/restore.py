"""Putting the run's jobs back: restore (after a restart), rebuild (same server, lost answer), adopt.

* :meth:`Restorer.restore` -- the *training client* after a restart: it creates the run's jobs again,
  ``/load-checkpoint``s the last good checkpoint, replays the :class:`~.journal.UpdateJournal` (every
  ``/forward-backward`` body and ``/step`` acknowledged since, in order) and pushes the weights to
  the sampler. The training job is then exactly where it was when the last acknowledged call
  returned: no step is applied twice, only the steps since the checkpoint are recomputed. The sampler
  gets the weights of the step it had before the restart (synced when the replay passes that step), so
  the version verl tags samples with stays true when the restart fell between a ``/step`` and its
  weight sync.
* :meth:`Restorer.rebuild_training` -- the same server, but the training job's state is unknown (an
  unanswered call that neither request-id replay nor a counter can settle): the training job alone
  is destroyed and built again the same way; the sampler and log_prob jobs stay.
* :meth:`Restorer.adopt` -- every other client (rollout replicas, the driver) waits until the
  restored jobs are ready (listed by ``/status``, tagged with this run's ``client_tag`` when the
  server echoes tags, the sampler synced) and uses them.

Re-entrant: a build that fails on the way -- an answer lost during the replay, a dropped connection
-- leaves the training job in an unknown state, so its half-built jobs are destroyed (and retired:
:attr:`~.state.RunState.retired`) and the build starts over, up to :data:`MAX_ATTEMPTS` times, then
a clear error. It never re-creates a job the client still holds: when the server restarted meanwhile
(:mod:`.restart`), the next attempt restores every job instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from arctic_rl.protocol import (
    JobType,
    LoadCheckpointRequest,
    LoadCheckpointResponse,
    Paths,
    StepResponse,
    WeightSyncResponse,
)
from verl.remote_backend.errors import (
    RemoteBackendError,
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteServerError,
)

from .answers import parse_answer
from .arctic_config import RecoveryConfig
from .dialect import Payload
from .jobs import JOB_ORDER, create_job, destroy_jobs, status_jobs
from .journal import CheckpointRef, JournalEntry, UpdateJournal
from .request import JobRequest
from .restart import RestartDetector
from .state import RunState

__all__ = ["MAX_ATTEMPTS", "Restorer"]

logger = logging.getLogger(__name__)

#: builds of the run's jobs tried for one restore or rebuild before it gives up with an error
MAX_ATTEMPTS = 3
_POLL_S = 0.5
_INTERRUPTED = (RemoteConnectionError, RemoteJobNotFoundError)


@dataclass(eq=False)
class Restorer:
    """Restore, rebuild and adopt the jobs of one client (see the module docstring).

    ``job_bodies()`` gives the ``/initialize`` bodies of the run's jobs; ``weight_sync`` is the request
    that pushes the training weights to the sampler (sent once, no recovery around it)."""

    state: RunState
    config: RecoveryConfig
    journal: UpdateJournal
    detector: RestartDetector
    stats: Counter[str]
    job_bodies: Callable[[], dict[JobType, dict]]
    weight_sync: JobRequest

    # ------------------------------------------------------------------------------ training client

    def restore(self, reason: str) -> None:
        """After a restart: every job of the run, built again."""
        self._build_until_done(reason, only_training=False)
        self.stats["restores"] += 1

    def rebuild_training(self, what: str) -> None:
        """Same server, training state unknown after ``what``: the training job alone, built again."""
        if not self.journal.complete:
            raise RemoteBackendError(
                f"arctic: {what} got no answer, the server neither replays request ids nor exposes a counter to tell "
                "whether it was applied, and this client cannot rebuild the training state (no complete journal): "
                "the run cannot continue exactly; resume it from its last checkpoint")
        old = self.state.job(JobType.TRAINING)
        self.state.retire([old])
        destroy_jobs(self.state.http, {JobType.TRAINING.value: old})
        self._build_until_done(f"{what} unanswered", only_training=True)
        self.stats["training_rebuilds"] += 1

    def _build_until_done(self, reason: str, *, only_training: bool) -> None:
        if self.journal.base is None and not self.journal.complete:  # before any job is created
            raise RemoteBackendError(
                f"arctic: the training state must be rebuilt ({reason}), but this client knows no checkpoint of the "
                "run and not every update since its start: the training state cannot be restored; resume the run "
                "from its last checkpoint")
        deadline = time.monotonic() + self.config.wait_s
        failures: list[str] = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            health = self.detector.wait_for_server(deadline)
            if only_training and failures and self.detector.restarted(health, jobs_gone=False):
                logger.warning("arctic: the server restarted while the training job was rebuilt: restoring every job")
                only_training = False
            try:
                self._build(reason, health, only_training=only_training)
                return
            except _INTERRUPTED as exc:  # the new jobs' state is unknown: they were destroyed, build again
                self.detector.down_seen = True
                failures.append(f"attempt {attempt}: {exc}")
                self.stats["rebuild_interrupted"] += 1
                logger.warning("arctic: %s of the training state was interrupted (%s); %s", "rebuild" if only_training
                               else "restore", exc, "starting over" if attempt < MAX_ATTEMPTS else "giving up")
                time.sleep(_POLL_S)
        raise RemoteBackendError(
            f"arctic: could not {'rebuild' if only_training else 'restore'} the training state ({reason}) in "
            f"{MAX_ATTEMPTS} attempts, each interrupted by a lost answer or connection: " + "; ".join(failures)
            + ". The run cannot continue exactly; resume it from its last checkpoint")

    def _build(self, reason: str, health: dict, *, only_training: bool) -> None:
        """One attempt: create, load, replay, publish (and sync the sampler after a restore). On any
        failure the jobs it created are destroyed and retired before the error goes on."""
        state, journal, http = self.state, self.journal, self.state.http
        logger.warning("arctic: %s the training state (%s): base %s, %d journalled call(s) with %d step(s)%s",
                       "rebuilding" if only_training else "restoring", reason, journal.base or "a fresh job",
                       len(journal.entries), journal.steps, "" if journal.complete else " -- JOURNAL INCOMPLETE")
        bodies = self.job_bodies()
        types = [JobType.TRAINING] if only_training else [t for t in JOB_ORDER if t.value in state.job_ids]
        created: dict[str, int] = {}
        try:
            for job_type in types:
                created[job_type.value] = create_job(http, job_type, bodies[job_type], tag=state.client_tag)
            # after a restore the sampler gets the weights of the step it had (sampler_step), synced when the replay
            # passes that step; where no replay can rebuild that step, the weights of the step reached (warned)
            sync_at = None if only_training else functools.partial(self._sync_sampler, {**state.job_ids, **created})
            step, synced = self._load_and_replay(created[JobType.TRAINING.value], sync_at)
            if not journal.complete:
                self._accept_lost_steps(step)
            elif step != state.step:
                raise RemoteBackendError(f"arctic: the rebuilt training job reached step {step}, but the client is at "
                                         f"step {state.step}; the run cannot continue exactly")
            state.publish_jobs({**state.job_ids, **created}, health.get("instance_id") or state.instance_id,
                               created=created)
            if sync_at is not None and not synced:  # a rebuilt training job holds the weights the sampler has
                if state.sampler_step is not None:
                    logger.warning("arctic: the restore cannot rebuild the weights of step %d that the sampler had "
                                   "(the checkpoint it starts from is of a later step, or steps were lost): it gets "
                                   "step %d's; samples sent before the next weight sync carry a version tag that "
                                   "differs from the weights that sampled them", state.sampler_step, step)
                sync_at(step)
        except BaseException:
            state.retire(created.values())
            destroy_jobs(http, created)
            raise

    def _load_and_replay(self, training: int, sync_at: Callable[[int], None] | None) -> tuple[int, bool]:
        """Load the journal's base into job ``training`` and replay the journal; ``sync_at(step)`` syncs the
        sampler when the training job is at :attr:`~.state.RunState.sampler_step` -- first through the journal's
        :attr:`~.journal.UpdateJournal.previous` part when the sampler's step precedes the base. The step reached,
        and whether the sampler was synced."""
        journal = self.journal
        target = self.state.sampler_step if sync_at is not None else None
        synced = False
        earlier_base, earlier_entries = journal.previous or (None, None)
        if (target is not None and journal.base is not None and target < journal.base.step
                and earlier_entries is not None and (earlier_base is None or earlier_base.step <= target)):
            try:  # the sampler's step, rebuilt on the way; then the newer base
                _, synced = self._replay(training, earlier_base, earlier_entries, target, sync_at,
                                         stop_when_synced=True)
            except RemoteServerError as exc:  # e.g. that checkpoint was pruned (recovery.checkpoint_keep)
                logger.warning("arctic: could not rebuild step %d for the sampler from %s: %s", target,
                               earlier_base or "a fresh job", exc)
        step, at_target = self._replay(training, journal.base, journal.entries if journal.complete else None,
                                       None if synced else target, sync_at)
        return step, synced or at_target

    def _replay(self, training: int, base: CheckpointRef | None, entries: list[JournalEntry] | None,
                target: int | None, sync_at: Callable[[int], None] | None, *,
                stop_when_synced: bool = False) -> tuple[int, bool]:
        """Load ``base`` (``None``: the freshly created job, step 0), replay ``entries`` (``None``: none, the journal
        being incomplete) and sync the sampler at step ``target``, stopping there if ``stop_when_synced``."""
        state = self.state
        step = 0
        if base is not None:
            body = LoadCheckpointRequest(path=base.path).model_dump(mode="json", exclude_none=True)
            load = JobRequest("POST", Paths.LOAD_CHECKPOINT, op="save", idempotent=True, payload=Payload(json=body))
            step = parse_answer(LoadCheckpointResponse, load.send(state, job_id=training).json(), load.what).global_step
            self.stats["checkpoints_loaded"] += 1
        synced = self._sync_if_at(step, target, sync_at)
        for entry in entries or ():  # each sent once: a lost answer here makes the caller start over
            if synced and stop_when_synced:
                break
            payload = Payload(content_type=entry.content_type, data=entry.body) if entry.content_type else \
                Payload(json=entry.body)
            replay = JobRequest("POST", entry.path, op="step" if entry.is_step else "forward_backward",
                                idempotent=False, payload=payload)
            resp = replay.send(state, job_id=training)
            if entry.is_step:
                got = parse_answer(StepResponse, resp.json(), replay.what).metrics.get("global_step")
                step = got if isinstance(got, int) and not isinstance(got, bool) else step + 1
                synced = synced or self._sync_if_at(step, target, sync_at)
            self.stats["journal_replayed"] += 1
        return step, synced

    @staticmethod
    def _sync_if_at(step: int, target: int | None, sync_at: Callable[[int], None] | None) -> bool:
        if sync_at is None or step != target:
            return False
        sync_at(step)
        return True

    def _sync_sampler(self, job_ids: dict[str, int], step: int) -> None:
        """Push the training job's weights (now those of ``step``) to the sampler of ``job_ids``."""
        jobs = dataclasses.replace(self.state, job_ids=job_ids)  # the jobs being built, not yet published
        sync = self.weight_sync
        parse_answer(WeightSyncResponse, sync.send(jobs).json(), sync.what)
        self.state.sampler_step = step
        if step != self.state.step:
            logger.warning("arctic: the restored sampler has the weights of step %d again, as before the restart (the "
                           "training job goes on to step %d; verl's next weight sync brings those)", step,
                           self.state.step)

    def _accept_lost_steps(self, step: int) -> None:
        state, journal = self.state, self.journal
        lost = state.step - step
        logger.error("arctic: the update journal was incomplete: restored step %d from %s; the %d step(s) since are "
                     "LOST (the server's step counter is now %d, verl's keeps counting)", step, journal.base, lost, step)
        self.stats["steps_lost"] += lost
        state.set_step(step)
        journal.reset(journal.base)

    # ------------------------------------------------------------------------------ other clients

    def adopt(self, reason: str) -> None:
        """Wait for the training client to restore, then use its jobs."""
        state = self.state
        deadline = time.monotonic() + self.config.wait_s
        wanted = [t for t in JOB_ORDER if t.value in state.job_ids]
        logger.warning("arctic: the server restarted (%s); waiting for the training client to restore the jobs", reason)
        while True:
            health = self.detector.wait_for_server(deadline)
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
            jobs = status_jobs(self.state.http)
        except (RemoteBackendError, AttributeError):
            return None
        found: dict[str, int] = {}
        for job_type in wanted:
            matches = [v for v in jobs if v.get("job_type") == job_type.value
                       and ("client_tag" not in v or v["client_tag"] == self.state.client_tag)]
            if len(matches) != 1:
                return None
            info = matches[0]
            if info.get("running") is False or str(info.get("status", "RUNNING")).upper() != "RUNNING":
                return None
            if job_type is JobType.SAMPLING and isinstance(info.get("weight_version"), int) and \
                    info["weight_version"] < 1:
                return None  # created, not yet synced with the restored weights
            found[job_type.value] = info["job_id"]
        return found
