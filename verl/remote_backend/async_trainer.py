"""Asynchronous GRPO through a remote backend, on verl 0.9.1's own V1 async machinery.

Switched on with ``trainer.v1.remote_backend.async_mode=true`` (``trainer.v1.remote_backend`` is
the option node verl reads for the ``remote_backend`` trainer mode). The trainer is then
``RemoteBackendAsyncTrainer`` (:class:`AsyncModeMixin` over the remote-backend trainer, composed in
:mod:`verl.remote_backend.trainer`), picked by ``RemoteBackendTrainer`` itself, so
``trainer.v1.trainer_mode`` stays ``remote_backend``.

Semantics: verl's asynchronous V1 modes without their sleeping of the sampler -- a backend owns
both jobs and keeps them resident, so nothing is aborted, put to sleep or woken between phases:

* before step 1, ``num_warmup_batches`` batches of prompts go to the backend (verl's
  ``_add_async_warmup_batches``); each step hands one more batch over (``prepare_step``) and
  samples the *oldest* finished one from verl's :class:`ReplayBufferAsync`, so the backend
  generates the next batch while this one's old log-probs and update run;
* after each update the weights reach the sampler (verl's checkpoint manager, ``global_steps``
  becomes the sampler's version); every sample carries the versions it was generated with
  (``min_global_steps``/``max_global_steps`` tags, set by the rollout server), and verl's
  staleness bound (``trainer.v1.sampler.max_off_policy_threshold``, ``max_off_policy_strategy``)
  decides what is trained, dropped or awaited;
* verl's own rollout correction (``algorithm.rollout_correction``) corrects for the lag as in the
  sync path.

A backend must say that its sampling job answers while its training job computes (see
:func:`concurrency_of`). A backend that says it cannot gets verl's sync semantics, with one log
line saying why; a backend that cannot say is refused with an error naming the key. The trainer
writes the mode it runs into the config (:data:`ACTIVE_KEY`, read by :func:`async_running`) before
verl creates its worker and rollout servers, so what they do between phases (the sampler's sleep,
:mod:`verl.remote_backend.workers.sampler_sleep`) follows the mode actually run, not the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from verl.utils.debug import marked_timer

from verl.remote_backend.base import RemoteBackendRegistry
from verl.remote_backend.context import attach_backend, ensure_backends_registered, install_context, read_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.strict_config import select

__all__ = [
    "ACTIVE_KEY",
    "ASYNC_KEY",
    "CONCURRENT_JOBS_FEATURE",
    "AsyncModeMixin",
    "async_requested",
    "async_running",
    "check_async_declared",
    "concurrency_listed",
    "concurrency_of",
    "keeps_answers_whole",
    "lag_metrics",
]

logger = module_logger(__name__)

#: the one switch of the asynchronous mode
ASYNC_KEY = "trainer.v1.remote_backend.async_mode"
#: written by the trainer once it has decided: whether the run is asynchronous (false after a fall-back to sync)
ACTIVE_KEY = "trainer.v1.remote_backend.async_active"
#: batches handed to the backend before step 1 (the prefetch window)
WARMUP_KEY = "trainer.v1.remote_backend.num_warmup_batches"
#: the feature a server lists in its capabilities when its sampling job answers while its training job runs
CONCURRENT_JOBS_FEATURE = "concurrent_jobs"
#: verl's trainer mode whose branches (async replay buffer, prompt persistence in TransferQueue,
#: its checkpoint and re-issue of in-flight prompts) the asynchronous remote mode takes
VERL_ASYNC_MODE = "colocate_async"


def async_requested(config: DictConfig) -> bool:
    """``trainer.v1.remote_backend.async_mode`` (absent = false); anything but a boolean is refused."""
    value = OmegaConf.select(config, ASYNC_KEY, default=False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RemoteBackendConfigError(ASYNC_KEY, "the asynchronous mode is switched on or off", allowed="true, false",
                                       received=value)
    return value


def async_running(config: Any) -> bool:
    """Whether the run is asynchronous: the trainer's decision (:data:`ACTIVE_KEY`) once taken, else the request
    (:data:`ASYNC_KEY`). ``config`` is verl's main config or a plain nested mapping (a backend's config snapshot)."""
    decided = select(config, ACTIVE_KEY, None)
    if decided is not None:
        return bool(decided)
    return select(config, ASYNC_KEY, False) is True


def _declared(backend: Any, method: str) -> tuple[bool, str] | None:
    """``backend.<method>()`` as ``(yes, why)``; ``None`` when the backend has no such method."""
    declare = getattr(backend, method, None)
    if not callable(declare):
        return None
    ok, why = declare()
    return bool(ok), str(why)


def concurrency_listed(features: Iterable[str]) -> tuple[bool, str]:
    """Whether a server whose ``/health`` lists ``features`` answers samples while it trains, and why: it must list
    :data:`CONCURRENT_JOBS_FEATURE`."""
    features = frozenset(features)
    if CONCURRENT_JOBS_FEATURE in features:
        return True, f"the server lists {CONCURRENT_JOBS_FEATURE!r}"
    listed = ", ".join(sorted(features)) or "none"
    return False, f"the server does not list the {CONCURRENT_JOBS_FEATURE!r} feature (it lists: {listed})"


def concurrency_of(backend: Any) -> tuple[bool | None, str]:
    """Whether ``backend``'s sampler answers while its trainer computes, and why.

    A backend says so with a ``concurrent_jobs() -> (bool, reason)`` method, or through the
    capabilities its server lists (a ``features`` set holding :data:`CONCURRENT_JOBS_FEATURE`).
    ``None``: the backend cannot say.
    """
    declared = _declared(backend, "concurrent_jobs")
    if declared is not None:
        return declared
    features = getattr(backend, "features", None)
    if isinstance(features, (set, frozenset)):
        return concurrency_listed(features)
    return None, (f"backend {type(backend).__name__} does not say whether its sampler answers while a training call "
                  f"runs (neither a concurrent_jobs() method nor a features set)")


def keeps_answers_whole(backend: Any) -> tuple[bool, str]:
    """Whether each answer of ``backend``'s sampler comes from one weight version when a weight sync lands while it
    generates, and why. A backend says so with a ``weight_sync_keeps_answers_whole() -> (bool, reason)`` method;
    one that does not say is taken not to, and its rollout servers hold new calls and wait for those in flight
    around each weight sync of the asynchronous mode (:mod:`verl.remote_backend.workers.weight_fence`)."""
    declared = _declared(backend, "weight_sync_keeps_answers_whole")
    if declared is not None:
        return declared
    return False, f"backend {type(backend).__name__} does not say (no weight_sync_keeps_answers_whole())"


def check_async_declared(config: DictConfig, name: str, backend_cls: type | None = None) -> None:
    """Refuse, before anything is created, an asynchronous run on a backend whose class cannot say whether its
    sampler answers while it trains (neither ``concurrent_jobs`` nor ``features``)."""
    if not async_requested(config):
        return
    if not OmegaConf.select(config, "trainer.use_v1", default=True):
        raise RemoteBackendConfigError(ASYNC_KEY, "the asynchronous mode runs on verl's V1 trainer (its async replay "
                                       "buffer); the legacy trainer route (trainer.use_v1=false) has none",
                                       allowed="false with trainer.use_v1=false", received=True)
    if backend_cls is None:
        ensure_backends_registered()
        backend_cls = RemoteBackendRegistry.get(name)
    if hasattr(backend_cls, "concurrent_jobs") or hasattr(backend_cls, "features"):
        return
    raise RemoteBackendConfigError(
        ASYNC_KEY, f"remote backend {name!r} ({backend_cls.__name__}) does not say whether its sampler answers while "
        "a training call runs, so the asynchronous mode cannot be run on it (docs/ASYNC.md: what a backend must "
        "provide); run it with the sync mode", allowed=False, received=True)


def lag_metrics(metrics: dict[str, Any], trained_samples: int) -> dict[str, float]:
    """The share of finished samples verl's replay buffer dropped for staleness this step."""
    dropped = float(metrics.get("training/off_policy/evicted_samples", 0) or 0)
    total = dropped + float(trained_samples)
    return {"training/off_policy/dropped_share": dropped / total if total else 0.0}


class AsyncModeMixin:
    """verl's asynchronous replay buffer and hooks over the remote-backend trainer (see the module docstring).

    Mixed in before :class:`~verl.remote_backend.trainer.RemoteBackendTrainer` (whose ``_owner``, ``backend_name``
    and verl's trainer state it uses) as ``RemoteBackendAsyncTrainer`` there.
    """

    def __init__(self, config: DictConfig):
        super().__init__(config)  # type: ignore[call-arg]
        self.async_active = False
        self.async_reason = "not decided yet"

    # ------------------------------------------------------------------ the decision
    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()  # the backend exists after this
        self._decide_async()

    def _decide_async(self) -> None:
        """Asynchronous when the backend answers samples while it trains; else sync (one log line)."""
        owned = self._owner.backend if self._owner is not None else None
        backend = owned if owned is not None else attach_backend(read_context(self.config))
        try:
            ok, why = concurrency_of(backend)
        finally:
            if owned is None:
                backend.destroy()  # an attached client owns nothing: this closes its connection only
        if ok is None:
            raise RemoteBackendConfigError(ASYNC_KEY, f"{why}; remote backend {self.backend_name!r} cannot run the "
                                           "asynchronous mode", allowed=False, received=True)
        self.async_reason = why
        if not ok:
            logger.warning("%s=true but %s: falling back to verl's sync mode (generation and training take turns)",
                           ASYNC_KEY, why)
            self._record_mode()
            return
        self.async_active = True
        self._record_mode()
        self.trainer_mode = VERL_ASYNC_MODE
        with open_dict(self.config):
            self.config.trainer.v1.trainer_mode = VERL_ASYNC_MODE
        self.replay_buffer = self._build_replay_buffer()  # verl's ReplayBufferAsync, our poll interval
        logger.info("asynchronous remote mode on (%s): the backend generates the next batch while this one trains; "
                    "staleness bound %s (%s)", why, self.config.trainer.v1.sampler.max_off_policy_threshold,
                    self.config.trainer.v1.sampler.max_off_policy_strategy)

    def _record_mode(self) -> None:
        """Write the mode decided into the config and the backend context that verl's worker and rollout
        servers, created after this, read (the context's snapshot was taken before the decision)."""
        OmegaConf.update(self.config, ACTIVE_KEY, self.async_active, force_add=True)
        context = read_context(self.config)
        install_context(self.config, name=context.name, handle=context.handle)

    # ------------------------------------------------------------------ verl's hooks
    def on_train_begin(self) -> None:
        if self.async_active:
            warmup = OmegaConf.select(self.config, WARMUP_KEY, default=1)
            self._add_async_warmup_batches(1 if warmup is None else warmup)
        else:
            super().on_train_begin()

    def on_sample_end(self) -> None:
        if not self.async_active:
            super().on_sample_end()  # sync: verl sleeps its replicas (a no-op for a remote sampler)
            return
        # the sampler keeps generating the next batch: no abort, no sleep
        if self.curr_step_profile:
            self._stop_rollout_profiling()

    def on_step_end(self) -> None:
        if not self.async_active:
            super().on_step_end()
            return
        with marked_timer("update_weights", self.timing_raw, color="red"):
            self.checkpoint_manager.update_weights(self.global_steps)  # the sampler's version becomes global_steps

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        if self.async_active:
            trained = sum(not tag.get("is_padding", False) for tag in batch.tags)
            metrics.update(lag_metrics(metrics, trained))
        metrics["training/off_policy/async_mode"] = float(self.async_active)
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
