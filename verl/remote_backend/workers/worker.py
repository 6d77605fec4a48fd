"""``RemoteActorRolloutRefWorker``: verl's actor/ref worker, forwarding to any remote backend.

verl's trainer drives one Ray worker per role with the method set of
``verl.workers.engine_workers.ActorRolloutRefWorker``. This worker implements that contract
(``init_model``, ``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``,
``update_weights``, ``save_checkpoint``, ``load_checkpoint``) without owning a model or a GPU:
each call is handed, unchanged, to the backend adapter that the worker re-attaches from the
driver's handle (see :mod:`verl.remote_backend.context`); the adapter must offer
:class:`~verl.remote_backend.protocols.RemoteActor`. The adapter owns the wire format and the
TensorDict shapes; the worker owns verl's dispatch annotations, the link to the rollout server
(weight version), and the on-disk checkpoint marker that makes verl's resume logic find remote
checkpoints.

``register_backend`` registers it (the default), or a backend's subclass of it, under the backend's name.
It *holds* an adapter; it is not one. It does not generate: generation goes through the rollout
replica (``replica.py``).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig
from tensordict import TensorDict
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from verl.remote_backend.async_trainer import async_running, keeps_answers_whole
from verl.remote_backend.context import BackendContext, attach_backend, read_context
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.remote_backend.logs import module_logger
from verl.remote_backend.protocols import ACTOR_METHODS, SAMPLER_UPDATE_KEY, RemoteActor, ReportsCallTimes
from verl.remote_backend.timings import PHASE_OF_METHOD, CallTotals, PhaseTimes
from verl.remote_backend.workers.sampler_sleep import RELEASED, RELEASED_METRIC
from verl.remote_backend.workers.tensor_fields import tensor_fields_dispatch
from verl.remote_backend.workers.weight_fence import fenced

__all__ = ["CHECKPOINT_MARKER", "RemoteActorRolloutRefWorker", "attach_rollout_server", "checkpoint_step"]

logger = module_logger(__name__)

#: file written into verl's ``global_step_N/actor`` folder: says where the remote checkpoint is
CHECKPOINT_MARKER = "remote_backend_checkpoint.json"
_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


def _timed_in_worker(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Time a registered compute method as Ray runs it -- verl's TransferQueue bridge reading the batch and writing
    the answer back, around the forwarded call -- under ``<phase>/worker``. Applied outside ``@register``: the
    registration's attributes reach the wrapper through ``functools.wraps``."""
    phase = PHASE_OF_METHOD[method]

    def decorate(registered: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(registered)
        def timed(self: RemoteActorRolloutRefWorker, *args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return registered(self, *args, **kwargs)
            finally:
                self._phase_times.add_worker(phase, time.monotonic() - start)

        return timed

    return decorate


class RemoteActorRolloutRefWorker(Worker):
    """Forwarder worker: verl's actor/rollout/ref role, computed by a remote backend.

    Args:
        config: verl's ``actor_rollout_ref`` node (carries the backend context, see module doc).
        role: verl's role string (``actor_rollout_ref``, ``actor_rollout``, ...).
        distillation_config: accepted for signature compatibility; distillation is not supported.
    """

    def __init__(self, config: DictConfig, role: str, distillation_config: Any = None, **kwargs: Any):
        super().__init__()
        if role not in _ROLES:
            raise RemoteBackendConfigError("role", "unknown verl worker role", allowed=list(_ROLES), received=role)
        self.config = config
        self.role = role
        self._distillation_config = distillation_config
        self._context: BackendContext = read_context(config)
        self._backend: RemoteActor | None = None
        self._rollout_servers: list[Any] = []
        self._warned_modes: set[str] = set()
        self._phase_times = PhaseTimes()
        self._fence: bool | None = None  # decided at the first weight sync
        self._released_bytes: float | None = None  # what the backend released as weight syncs woke its sampler

    # ------------------------------------------------------------------ lifecycle
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Re-attach to the driver's backend and register dispatch info for every mesh verl uses."""
        start = time.monotonic()
        backend = attach_backend(self._context)
        missing = [m for m in ACTOR_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise RemoteBackendConfigError(
                "remote_backend.name", f"backend {type(backend).__name__} lacks the actor methods {missing}",
                allowed="a backend implementing verl.remote_backend.protocols.RemoteActor", received=self._context.name,
            )
        self._backend = backend
        for mesh in ("actor", "ref", "rollout"):
            self._register_dispatch_collect_info(mesh, dp_rank=self.rank, is_collect=True)
        logger.info(
            "remote backend %r attached for role %s in %.2f s", self._context.name, self.role, time.monotonic() - start
        )

    @property
    def backend(self) -> RemoteActor:
        if self._backend is None:
            raise RuntimeError(f"{type(self).__name__}: init_model() has not run (no backend attached)")
        return self._backend

    def attach_rollout_server(self, server: Any) -> None:
        """Remember a rollout server actor, told the weight version after each weight sync."""
        if server not in self._rollout_servers:
            self._rollout_servers.append(server)

    # ------------------------------------------------------------------ compute
    @_timed_in_worker("compute_log_prob")
    @register(dispatch_mode=tensor_fields_dispatch("actor", "compute_log_prob"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        """Old-policy log-probs (and entropy) under the current training weights."""
        return self._forward("compute_log_prob", data)

    @_timed_in_worker("compute_ref_log_prob")
    @register(dispatch_mode=tensor_fields_dispatch("ref", "compute_ref_log_prob"))
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        """Reference-policy (initial weights) log-probs."""
        return self._forward("compute_ref_log_prob", data)

    @_timed_in_worker("update_actor")
    @register(dispatch_mode=tensor_fields_dispatch("actor", "update_actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        """PPO/GRPO update of the remote actor; returns verl's ``metrics`` (incl. ``mfu``)."""
        return self._forward("update_actor", data)

    def _forward(self, method: str, data: TensorDict) -> TensorDict:
        self._drain_call_times()  # whatever ran between two phases is not this one's
        start = time.monotonic()
        output = getattr(self.backend, method)(data)
        seconds = time.monotonic() - start
        self._phase_times.add(PHASE_OF_METHOD[method], seconds, self._drain_call_times())
        logger.debug("%s: %d rows in %.2f s", method, len(data), seconds)
        return output

    def _drain_call_times(self) -> CallTotals | None:
        backend = self._backend
        if not isinstance(backend, ReportsCallTimes):
            return None
        return CallTotals.from_mapping(backend.drain_call_times())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def collect_phase_timings(self) -> dict[str, float]:
        """Seconds per phase since the last collect, as verl ``timing_raw`` entries: ``<phase>/worker`` (the
        worker method, verl's TransferQueue bridge included), ``<phase>/adapter`` (the forwarded call in it), ``<phase>/http`` (the backend's calls, when it reports them) and
        ``<phase>/server`` (the server's own seconds, when the server reports them); and, where the backend
        released device memory as a weight sync woke its sampler, those bytes under ``RELEASED_METRIC``."""
        out = self._phase_times.collect()
        if self._released_bytes is not None:
            out[RELEASED_METRIC], self._released_bytes = self._released_bytes, None
        return out

    # ------------------------------------------------------------------ weights
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        """Make the remote sampler serve the latest trained weights, then tell the rollout
        servers the new weight version (``global_steps``). A backend whose sampler lives in the
        rollout server's process returns ``{SAMPLER_UPDATE_KEY: <JSON data>}``; the servers hand it
        to their backend's ``adopt_sampler`` (:class:`~verl.remote_backend.protocols.SamplerAdopter`). ``mode`` names verl's checkpoint
        engine; the backend moves weights itself, so every mode means the same here."""
        if mode not in ("auto", "naive") and mode not in self._warned_modes:
            self._warned_modes.add(mode)
            logger.warning("update_weights(mode=%r): the remote backend syncs weights itself; mode ignored", mode)
        start = time.monotonic()
        sync = self.backend.update_weights
        self._drain_call_times()
        async with fenced(self._rollout_servers, self._fence_weight_syncs()) as held:
            if inspect.iscoroutinefunction(sync):  # a backend written for verl PR #7102's async interface
                result = await sync()
            else:
                result = await asyncio.to_thread(sync)
            self._phase_times.add(PHASE_OF_METHOD["update_weights"], time.monotonic() - start,
                                  self._drain_call_times())
            sampler = result.get(SAMPLER_UPDATE_KEY) if isinstance(result, Mapping) else None
            released = result.get(RELEASED) if isinstance(result, Mapping) else None
            if isinstance(released, (int, float)) and not isinstance(released, bool):
                self._released_bytes = (self._released_bytes or 0.0) + float(released)
            if sampler is not None and self._rollout_servers:
                await asyncio.gather(*[s.adopt_sampler.remote(sampler) for s in self._rollout_servers])
            if global_steps is not None and self._rollout_servers:
                await asyncio.gather(*[s.set_global_steps.remote(int(global_steps)) for s in self._rollout_servers])
        fence = f" (fenced: waited {held['wait_s']:.2f} s for {int(held['calls'])} calls in flight)" if held else ""
        logger.info("weights synced (global_steps=%s) in %.2f s%s", global_steps, time.monotonic() - start, fence)
        return {}

    def _fence_weight_syncs(self) -> bool:
        """Whether this weight sync must hold the rollout servers' calls (:mod:`.weight_fence`): in the asynchronous
        mode, for a backend that does not keep each answer on one weight version across a sync. Decided once."""
        if self._fence is None:
            whole, why = keeps_answers_whole(self.backend)
            self._fence = async_running(self._context.main_config_node()) and not whole
            if self._fence:
                logger.info("asynchronous mode: each weight sync waits for the samples in flight and holds new ones "
                            "(%s)", why)
        return self._fence

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        """Save the remote training state (weights + optimizer) as step ``global_step`` and write a
        marker into ``local_path`` so that verl's resume finds it. ``hdfs_path`` and
        ``max_ckpt_to_keep`` concern local files verl would write; the backend keeps its own."""
        start = time.monotonic()
        result = self.backend.save_checkpoint(step=int(global_step))
        os.makedirs(local_path, exist_ok=True)
        marker = {"backend": self._context.name, "global_step": int(global_step), "result": _jsonable(result)}
        tmp = os.path.join(local_path, CHECKPOINT_MARKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(local_path, CHECKPOINT_MARKER))
        logger.info("remote checkpoint of step %d saved in %.2f s", global_step, time.monotonic() - start)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False) -> None:
        """Restore the remote training state saved by :meth:`save_checkpoint` for ``local_path``."""
        step = checkpoint_step(local_path)
        start = time.monotonic()
        self.backend.load_checkpoint(step=step)
        logger.info("remote checkpoint of step %d loaded in %.2f s", step, time.monotonic() - start)

    # ------------------------------------------------------------------ profiling (not supported)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, **kwargs: Any) -> None:
        logger.warning("profiling runs on the remote backend, not in the forwarder worker; start_profile ignored")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> None:
        return None


def checkpoint_step(local_path: str) -> int:
    """The global step of the checkpoint whose verl folder is ``local_path``: from the marker
    written by ``save_checkpoint``, else from a ``global_step_<N>`` path component."""
    marker = os.path.join(local_path, CHECKPOINT_MARKER)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    match = re.search(r"global_step_(\d+)", local_path)
    if match is None:
        raise RemoteBackendConfigError(
            "load_checkpoint.local_path",
            f"cannot tell which remote checkpoint to load: no {CHECKPOINT_MARKER} and no global_step_<N> in the path",
            received=local_path,
        )
    return int(match.group(1))


def attach_rollout_server(actor_self: Any, server: Any) -> int:
    """Run inside a verl worker actor (``worker.__ray_call__.remote(attach_rollout_server, s)``):
    hand ``server`` to every forwarder worker the actor hosts; return how many took it."""
    hosted = getattr(actor_self, "worker_dict", None)
    workers = list(hosted.values()) if isinstance(hosted, dict) else [actor_self]
    count = 0
    for worker in workers:
        if isinstance(worker, RemoteActorRolloutRefWorker):
            worker.attach_rollout_server(server)
            count += 1
    return count


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)
