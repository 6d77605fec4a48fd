"""How stock verl 0.9.1 drives a remote backend: a V1 trainer mode, CPU resource pools, task runners.

* :class:`RemoteBackendTrainer` -- verl's synchronous V1 trainer (``PPOTrainerSync``) registered
  as ``trainer.v1.trainer_mode=remote_backend``. It swaps verl's local FSDP actor worker for the
  backend's forwarder worker (``RemoteBackendRegistry.get_worker``), puts that one worker in a
  resource pool that needs no GPU (:class:`CpuResourcePoolManager`), hands the backend's handle
  to the worker and the rollout replica through the config (:mod:`verl.remote_backend.context`),
  creates the backend itself when nobody did (plugin route) and then destroys it at the end, and
  polls the replay buffer every ``poll_interval_s`` instead of verl's fixed 2 s, and prints one
  progress line per step with an ETA (``verl.remote_backend.progress``) next to verl's long metric line. It
  stamps each generation phase (hand-over to verl's agent loop, samples back) and sets the stamps against the
  rollout servers' first call and last answer (:class:`~verl.remote_backend.timings.GenerationWindow`).
  Semantics are verl's ``sync`` mode: ``trainer.v1.trainer_mode`` is only the registry name; with
  ``trainer.v1.remote_backend.async_mode=true`` the trainer is the asynchronous one of
  :mod:`verl.remote_backend.async_trainer` (verl's async replay buffer, no sleeping of the sampler).
* :data:`RemoteBackendTaskRunnerV1` -- verl's V1 task runner, but imported from here so that the
  trainer mode is registered in the runner process without ``VERL_USE_EXTERNAL_MODULES``. It waits for verl's
  agent-loop worker actors to start before step 1 (verl creates them after ``trainer.init()``, and the first
  ``generate_sequences`` would otherwise wait for their processes and imports inside step 1's timers: 10 s on a
  CPU, ~20 s on an H200), and logs how long that took.
* :data:`RemoteBackendTaskRunnerV0` -- the legacy ``RayPPOTrainer`` route (``trainer.use_v1=False``)
  with the same worker and pools.

Not here: config derivation (``settings.py``), backend lifetime (``lifecycle.py``), the entry point.
"""

from __future__ import annotations

import time
from typing import Any, Self

import numpy as np
import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.single_controller.ray.base import RayResourcePool, RayWorkerGroup, ResourcePoolManager
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.main_ppo_v0 import BaseTaskRunner, TaskRunner
from verl.trainer.ppo.utils import Role, need_critic, need_reference_policy
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl.remote_backend.async_trainer import AsyncModeMixin, async_requested, check_async_declared
from verl.remote_backend.base import RemoteBackendRegistry
from verl.remote_backend.context import ensure_backends_registered, install_context, read_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.lifecycle import BackendOwner, backend_name
from verl.remote_backend.logs import module_logger
from verl.remote_backend.progress import StepClock, format_progress
from verl.remote_backend.settings import (
    FORWARDER_BUNDLE_CPUS,
    RAY_START_OPTION,
    SCHEDULING_HEADROOM_CPUS,
    TRAINER_MODE,
    apply_forced_settings,
)
from verl.remote_backend.timings import GenerationWindow
from verl.remote_backend.workers.sampler_sleep import DECLINED_METRIC, RELEASED_METRIC
from verl.remote_backend.workers.tensor_fields import declare_fields_read

__all__ = [
    "CpuResourcePoolManager",
    "RemoteBackendAsyncTrainer",
    "RemoteBackendTaskRunnerV0",
    "RemoteBackendTaskRunnerV1",
    "RemoteBackendTrainer",
    "prepare_remote_backend_config",
]

logger = module_logger(__name__)

GLOBAL_POOL = "global_pool"


class CpuResourcePoolManager(ResourcePoolManager):
    """A ``ResourcePoolManager`` whose pools reserve CPUs only (forwarder workers own no GPU).

    Checks that Ray has the CPUs before asking for them: a placement group that cannot be
    placed waits forever, so an error naming what sets Ray's CPUs is better.
    """

    def create_resource_pool(self) -> None:
        self.check_cpus()
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes,
                use_gpu=False,
                max_colocate_count=self.max_colocate_count,
                name_prefix=name,
            )

    def check_cpus(self) -> None:
        """Raise :class:`RemoteBackendConfigError` when Ray lacks the CPUs of these pools, naming
        what sets them: ``ray start --num-cpus`` on a running cluster (a submitted job cannot set
        them), ``ray_kwargs.ray_init.num_cpus`` for the Ray this run started."""
        needed = sum(sum(procs) for procs in self.resource_pool_spec.values()) * self.max_colocate_count
        free = ray.available_resources().get("CPU", 0.0)
        if free >= needed:
            return
        total = ray.cluster_resources().get("CPU", 0.0)
        enough = int(total - free) + needed + SCHEDULING_HEADROOM_CPUS
        raise RemoteBackendConfigError(
            RAY_START_OPTION,
            f"Ray has {free:g} of {total:g} logical CPUs free, the forwarder worker pool needs {needed}; verl would "
            f"wait for them forever. On a running cluster start the head with `ray start --head --num-cpus={enough}` "
            f"(logical CPUs are Ray's scheduling slots, not cores); for the Ray this run starts itself set "
            f"ray_kwargs.ray_init.num_cpus={enough}",
            allowed=f">= {enough} logical CPUs in all", received=total,
        )


def prepare_remote_backend_config(config: DictConfig) -> str:
    """Check and complete a composed config for a remote-backend run (in place); return the
    backend name. Refuses what a forwarder cannot do (critic, reward-model or teacher pools,
    ``rollout.name`` of another engine) with errors naming the key; derives the rest."""
    name = backend_name(config)
    notes = apply_forced_settings(
        config,
        name,
        has_accelerator=True,  # never flip trainer.device here: Ray actors see no GPU anyway
        strict_keys=("actor_rollout_ref.rollout.name",),
    )
    for note in notes:
        logger.info("remote backend setting: %s", note)
    if need_critic(config):
        raise RemoteBackendConfigError(
            "algorithm.adv_estimator", "a critic would train locally; the remote backend runs critic-free estimators",
            allowed="grpo, rloo, reinforce_plus_plus, ... (no critic)", received=config.algorithm.adv_estimator,
        )
    if config.reward.reward_model.get("enable", False):
        raise RemoteBackendConfigError(
            "reward.reward_model.enable", "a model-based reward would run a local inference engine; use a rule-based "
            "or custom reward function with a remote backend", allowed=False, received=True,
        )
    check_async_declared(config, name)  # a backend that cannot run the asynchronous mode: before it is created
    distillation = config.get("distillation")
    if distillation is not None and distillation.get("enabled", False):
        raise RemoteBackendConfigError("distillation.enabled", "distillation is not supported with a remote backend", allowed=False, received=True)
    return name


def _forwarder(config: DictConfig, name: str) -> tuple[Role, type]:
    """The role (with or without the reference policy) and worker class of backend ``name``."""
    ensure_backends_registered()
    role = Role.ActorRolloutRef if need_reference_policy(config) else Role.ActorRollout
    return role, RemoteBackendRegistry.get_worker(name)


def _forwarder_pool(config: DictConfig, mapping: dict) -> CpuResourcePoolManager:
    """The one CPU-only pool of the forwarder worker (verl's reward-model slot sized to match)."""
    with open_dict(config):
        config.reward.reward_model.nnodes = 1
        config.reward.reward_model.n_gpus_per_node = 1
    return CpuResourcePoolManager(
        resource_pool_spec={GLOBAL_POOL: [1]}, mapping=mapping, max_colocate_count=FORWARDER_BUNDLE_CPUS
    )


@register_trainer(TRAINER_MODE)
class RemoteBackendTrainer(PPOTrainerSync):
    """verl's sync V1 trainer with the actor, reference and rollout on a remote backend."""

    #: seconds between the replay buffer's checks for finished rollouts (verl: fixed 2.0)
    poll_interval_s: float = 0.05
    #: the current step's generation phase, stamped (``timing_s/gen/submit``, ``/to_first_call``, ...)
    _gen_window: GenerationWindow | None = None

    def __new__(cls, config: DictConfig, *args: Any, **kwargs: Any) -> Self:
        """``trainer.v1.remote_backend.async_mode=true`` makes this mode's trainer the asynchronous one
        (:mod:`verl.remote_backend.async_trainer`); verl's registry holds one name per mode."""
        if cls is RemoteBackendTrainer and async_requested(config):
            return object.__new__(RemoteBackendAsyncTrainer)
        return object.__new__(cls)

    def __init__(self, config: DictConfig):
        self.backend_name = prepare_remote_backend_config(config)
        ensure_backends_registered()
        read = declare_fields_read(RemoteBackendRegistry.get(self.backend_name))  # this process's dispatches
        if read:
            logger.info("backend %r reads these tensor fields per call: %s", self.backend_name,
                        {method: sorted(fields) for method, fields in read.items()})
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"  # verl's sync semantics everywhere it branches on the name
        self._owner: BackendOwner | None = None
        self._step_clock = StepClock()
        super().__init__(config)

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        phases = self._phase_timings()
        released_at_syncs = phases.pop(RELEASED_METRIC, None)  # bytes, not seconds
        timing_raw.update(phases)  # -> timing_s/<phase>/adapter, /http, /server beside verl's
        generation = self._generation_timings()
        calls = generation.pop("gen/backend_calls", None)
        declined = generation.pop(DECLINED_METRIC, None)  # a count of sleeps, not seconds
        released = generation.pop(RELEASED_METRIC, None)
        if released_at_syncs is not None:
            released = (released or 0.0) + released_at_syncs
        timing_raw.update(generation)  # -> timing_s/gen/backend_busy, /http_sum, /server_sum, /calls_span, ...
        if calls is not None:
            metrics["perf/remote_backend/gen_calls"] = calls
        if declined is not None:
            metrics["perf/remote_backend/sampler_sleeps_declined"] = declined
        if released is not None:  # memory, not time: beside the counts
            metrics["perf/remote_backend/sampler_released_gib"] = released / 2**30
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        for key, value in metrics.items():  # verl's off-policy metrics are numpy scalars: print them as numbers
            if isinstance(value, np.generic):
                metrics[key] = value.item()
        self._step_clock.add(metrics)
        eta_s = self._step_clock.eta_s(global_steps, self.total_training_steps)
        line = format_progress(metrics, global_steps, self.total_training_steps, eta_s=eta_s)
        print(f"[remote_backend] {line}", flush=True)

    def _phase_timings(self) -> dict[str, float]:
        """The forwarder workers' seconds per phase since the last step (summed over workers)."""
        collect = getattr(self.actor_rollout_wg, "collect_phase_timings", None)
        if collect is None:
            return {}
        totals: dict[str, float] = {}
        for part in collect():
            for key, seconds in (part or {}).items():
                totals[key] = totals.get(key, 0.0) + float(seconds)
        return totals

    def prepare_step(self) -> dict:
        """verl's hand-over of the step's batch to its agent loop, stamped for :class:`GenerationWindow`."""
        self._ask_rollout_servers("drain_call_window")  # calls since the last phase (validation's) are not this one's
        began = time.time()
        out = super().prepare_step()
        self._gen_window = GenerationWindow(submit_began=began, submit_ended=time.time())
        return out

    def on_sample_end(self) -> None:
        """The samples are back: close the phase's window (before verl puts the sampler to sleep)."""
        window = self._gen_window
        if window is not None and window.sampled is None:
            window.close(time.time(), self._ask_rollout_servers("drain_call_window"))
        super().on_sample_end()

    def _generation_timings(self) -> dict[str, float]:
        """The rollout servers' generation figures since the last step (summed over servers; see
        :meth:`~verl.remote_backend.workers.replica.RemoteRolloutServer.collect_generation_timings`), and the
        phase's window (:class:`GenerationWindow`; sync mode)."""
        window, self._gen_window = self._gen_window, None
        totals: dict[str, float] = window.timings() if window is not None else {}
        for part in self._ask_rollout_servers("collect_generation_timings"):
            for key, value in (part or {}).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    def _ask_rollout_servers(self, method: str) -> list[dict[str, float]]:
        """Each rollout server's answer to ``method`` (none for replicas of another kind)."""
        manager = getattr(self, "llm_server_manager", None)
        replicas = manager.get_replicas() if manager is not None and hasattr(manager, "get_replicas") else []
        servers = [s for r in replicas for s in getattr(r, "servers", [])]
        if not servers:
            return []
        try:
            return list(ray.get([getattr(s, method).remote() for s in servers], timeout=30))
        except (AttributeError, ray.exceptions.RayError) as exc:  # a replica of another kind: no figures
            logger.debug("no %s from the rollout servers: %s", method, exc)
            return []

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = self.poll_interval_s
        return buffer

    def _init_resource_pool_mgr(self) -> None:
        """One forwarder worker in a CPU-only pool; create or re-attach the backend now that
        the data loader has set ``optim.total_training_steps``."""
        role, worker_cls = _forwarder(self.config, self.backend_name)
        self.role_worker_mapping = {role: ray.remote(worker_cls)}
        self.mapping = {role: GLOBAL_POOL, Role.RewardModel: GLOBAL_POOL}
        self.resource_pool_manager = _forwarder_pool(self.config, self.mapping)
        self.resource_pool_manager.check_cpus()  # before creating remote jobs we could not use
        self._attach_or_create_backend()

    def _attach_or_create_backend(self) -> None:
        try:
            handle = read_context(self.config).handle
        except RemoteBackendConfigError:
            handle = None
        if handle:
            install_context(self.config, name=self.backend_name, handle=handle)  # refresh the config snapshot
        else:
            logger.info("creating remote backend %r in the trainer (plugin route)", self.backend_name)
            self._owner = BackendOwner.create(self.config)

    def init(self) -> None:
        try:
            super().init()
        except BaseException:
            self._destroy_owned()
            raise

    def fit(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().fit(*args, **kwargs)
        finally:
            self._destroy_owned()

    def _destroy_owned(self) -> None:
        if self._owner is not None:
            self._owner.destroy()


class RemoteBackendAsyncTrainer(AsyncModeMixin, RemoteBackendTrainer):
    """The remote-backend trainer in the asynchronous mode (``trainer.v1.remote_backend.async_mode=true``)."""


class _TaskRunnerV1(TaskRunnerV1.__ray_actor_class__):
    """verl's V1 task runner; defined here so that unpickling it registers our trainer mode."""

    def init_agent_loop_manager(self) -> None:
        """verl's, then wait until its worker actors have started (module docstring)."""
        super().init_agent_loop_manager()
        workers = list(getattr(self.agent_loop_manager, "agent_loop_workers", None) or [])
        if workers:
            t0 = time.perf_counter()
            ray.get([worker.__ray_ready__.remote() for worker in workers])
            logger.info("%d agent-loop workers started in %.1fs (before step 1)", len(workers),
                        time.perf_counter() - t0)


RemoteBackendTaskRunnerV1 = ray.remote(_TaskRunnerV1)


class _TaskRunnerV0(BaseTaskRunner):
    """verl's legacy task runner with the forwarder worker and the CPU-only pool."""

    def add_actor_rollout_worker(self, config: DictConfig):
        role, worker_cls = _forwarder(config, prepare_remote_backend_config(config))
        self.role_worker_mapping[role] = ray.remote(worker_cls)
        self.mapping[role] = GLOBAL_POOL
        return worker_cls, RayWorkerGroup

    def add_critic_worker(self, config: DictConfig) -> None:
        return None  # refused by prepare_remote_backend_config

    def init_resource_pool_mgr(self, config: DictConfig) -> CpuResourcePoolManager:
        return _forwarder_pool(config, self.mapping)

    def run(self, config: DictConfig) -> None:
        if not read_context(config).handle:
            raise RemoteBackendConfigError(
                "trainer.use_v1", "the legacy trainer route needs the backend created by "
                "`python -m verl.remote_backend.main_ppo`", allowed=True, received=False,
            )
        OmegaConf.resolve(config)
        install_context(config, name=backend_name(config), handle=read_context(config).handle)
        return TaskRunner.__ray_actor_class__.run(self, config)


RemoteBackendTaskRunnerV0 = ray.remote(_TaskRunnerV0)
