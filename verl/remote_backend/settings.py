"""The verl settings a remote-backend run derives, instead of asking the user for them.

With a remote backend, verl runs *one* forwarder worker that owns no accelerator and one
rollout replica of tensor-parallel size 1; the backend's own config (``remote_backend.*``) says
how many devices it uses. So whatever a stock GRPO recipe says about ``trainer.n_gpus_per_node``,
``rollout.name`` or ``rollout.tensor_model_parallel_size``, a remote-backend run uses the values
of :func:`forced_settings`. Two ways to apply them:

* :func:`rewrite_overrides` edits Hydra's command line before composition (our entry point), so
  ``--cfg job`` shows exactly what runs; every dropped user override is reported;
* :func:`apply_forced_settings` edits a composed config in place (the plugin route, where the
  command line belongs to stock ``main_ppo``).

:func:`required_ray_cpus` / :func:`ensure_ray_cpus` size Ray's logical CPUs for a local run:
stock verl leaves ``ray_init.num_cpus`` at the machine's core count, and on a small machine the
worker and TransferQueue placement groups then wait forever without an error. On a running
cluster (``ray job submit``) the run cannot size them: :func:`check_cluster_cpus` refuses to start
on too few, naming the ``ray start`` option that sets them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "RAY_START_OPTION",
    "TRAINER_MODE",
    "apply_forced_settings",
    "check_cluster_cpus",
    "ensure_ray_cpus",
    "forced_settings",
    "joins_running_cluster",
    "required_ray_cpus",
    "rewrite_overrides",
    "selected_backend",
]

#: verl V1 trainer mode registered by ``verl.remote_backend.trainer``
TRAINER_MODE = "remote_backend"
#: CPUs of one forwarder worker's placement-group bundle (``max_colocate_count`` of our pool)
FORWARDER_BUNDLE_CPUS = 1
#: headroom for actors that need one CPU to be *scheduled* (task runner, agent-loop and reward workers)
SCHEDULING_HEADROOM_CPUS = 2
#: where a running cluster's logical CPUs are set (the run itself cannot change them)
RAY_START_OPTION = "ray start --num-cpus"

_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2}|~)(?P<key>[A-Za-z0-9_.@/\-]+)=(?P<value>.*)$", re.DOTALL)


def forced_settings(backend_name: str, *, has_accelerator: bool) -> dict[str, Any]:
    """Dotted key -> value that every remote-backend run uses (see the module docstring)."""
    forced: dict[str, Any] = {
        "actor_rollout_ref.rollout.name": backend_name,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        "actor_rollout_ref.rollout.data_parallel_size": 1,
        "actor_rollout_ref.rollout.pipeline_model_parallel_size": 1,
        "trainer.n_gpus_per_node": 1,
        "trainer.nnodes": 1,
        "trainer.v1.trainer_mode": TRAINER_MODE,
    }
    if not has_accelerator:
        forced["trainer.device"] = "cpu"
    return forced


def selected_backend(overrides: Sequence[str]) -> str | None:
    """The backend chosen on a Hydra command line (``remote_backend=X``, ``+remote_backend=X``)."""
    chosen = None
    for token in overrides:
        match = _OVERRIDE.match(token)
        if match and match.group("key") == "remote_backend" and match.group("prefix") != "~":
            chosen = match.group("value").strip() or None
    return chosen


def rewrite_overrides(overrides: Sequence[str], *, has_accelerator: bool) -> tuple[list[str], list[str]]:
    """Drop user overrides of forced keys and append the forced values.

    Returns ``(new_overrides, notes)``; ``notes`` says which user values were replaced. Without a
    ``remote_backend=<name>`` token nothing changes (the entry point reports that error itself).
    """
    backend = selected_backend(overrides)
    if backend is None:
        return list(overrides), []
    forced = forced_settings(backend, has_accelerator=has_accelerator)
    kept: list[str] = []
    notes: list[str] = []
    for token in overrides:
        match = _OVERRIDE.match(token)
        key = match.group("key") if match else None
        if key in forced:
            if match.group("value") != str(forced[key]):
                notes.append(f"{key}={match.group('value')} replaced by {key}={forced[key]} (remote backend {backend!r})")
            continue
        kept.append(token)
    # right after the last override: Hydra's argparse takes overrides as one positional run
    last = max(i for i, token in enumerate(kept) if _OVERRIDE.match(token))
    kept[last + 1 : last + 1] = [f"{key}={value}" for key, value in forced.items()]
    return kept, notes


def apply_forced_settings(config: DictConfig, backend_name: str, *, has_accelerator: bool, strict_keys: Sequence[str] = ()) -> list[str]:
    """Set the forced values in ``config`` (in place); return one note per changed value.

    A key in ``strict_keys`` whose value differs raises :class:`RemoteBackendConfigError` instead
    of being changed (the plugin route refuses a wrong ``rollout.name`` rather than guessing).
    """
    notes: list[str] = []
    for key, value in forced_settings(backend_name, has_accelerator=has_accelerator).items():
        current = OmegaConf.select(config, key, default=None, throw_on_missing=False)
        if current == value:
            continue
        if key in strict_keys:
            raise RemoteBackendConfigError(key, f"remote backend {backend_name!r} needs this setting", allowed=value, received=current)
        with open_dict(config):
            OmegaConf.update(config, key, value, merge=False, force_add=True)
        notes.append(f"{key}: {current!r} -> {value!r} (remote backend {backend_name!r})")
    return notes


def required_ray_cpus(config: DictConfig) -> int:
    """Logical CPUs a local Ray cluster needs for this run not to wait forever."""
    cpus = FORWARDER_BUNDLE_CPUS + SCHEDULING_HEADROOM_CPUS
    if OmegaConf.select(config, "trainer.use_v1", default=True):
        units = OmegaConf.select(config, "transfer_queue.backend.SimpleStorage.num_data_storage_units", default=1)
        cpus += 1 + int(units or 0)  # TransferQueue controller + one CPU per storage unit
    return cpus


def joins_running_cluster(config: DictConfig) -> bool:
    """Whether ``ray.init`` will join a running cluster: ``ray_kwargs.ray_init.address``, or
    ``RAY_ADDRESS`` (set by Ray in a submitted job's driver), names one (``local`` does not)."""
    ray_init = OmegaConf.select(config, "ray_kwargs.ray_init", default=None)
    address = ray_init.get("address") if ray_init is not None else None
    if address in (None, ""):
        address = os.environ.get("RAY_ADDRESS")
    return address not in (None, "", "local")


def ensure_ray_cpus(config: DictConfig) -> str | None:
    """Raise ``ray_kwargs.ray_init.num_cpus`` to :func:`required_ray_cpus` for a local cluster.

    Left alone when the run joins a running cluster (:func:`joins_running_cluster`): its
    resources are what ``ray start`` gave it (:func:`check_cluster_cpus`), and ``ray.init``
    refuses ``num_cpus`` when it connects to one. Returns a note when the value changed.
    """
    if joins_running_cluster(config):
        return None
    ray_init = OmegaConf.select(config, "ray_kwargs.ray_init", default=None)
    needed = required_ray_cpus(config)
    current = None if ray_init is None else ray_init.get("num_cpus")
    effective = int(current) if current is not None else (os.cpu_count() or 1)  # Ray's own default
    if effective >= needed:
        return None
    with open_dict(config):
        OmegaConf.update(config, "ray_kwargs.ray_init.num_cpus", needed, merge=False, force_add=True)
    return (
        f"ray_kwargs.ray_init.num_cpus: {current!r} -> {needed} (forwarder bundle + TransferQueue + "
        "scheduling headroom; logical CPUs, not cores)"
    )


def check_cluster_cpus(config: DictConfig, *, total: float, free: float) -> None:
    """Refuse to start on a running Ray cluster with fewer free logical CPUs than the run needs.

    Without them verl's placement groups and actors wait forever; the fix is on the cluster's side
    (``ray start --num-cpus``: logical CPUs are the slots Ray hands out, not cores; a node started
    without the option gets one per core), never in this run's config.
    """
    needed = required_ray_cpus(config)
    if free >= needed:
        return
    if total < needed:
        remedy = f"start the head with `ray start --head --num-cpus={needed}` (or more)"
    else:
        remedy = "wait for the cluster's other jobs to finish, or add a node (`ray start --address <head>:6379`)"
    raise RemoteBackendConfigError(
        RAY_START_OPTION,
        f"the running Ray cluster has {free:g} of {total:g} logical CPUs free and this run needs {needed} "
        "(TransferQueue controller and storage units, the forwarder worker, room to place verl's task runner, "
        f"agent-loop and reward workers; logical CPUs are Ray's scheduling slots, not cores): {remedy}",
        allowed=f">= {needed} free", received=free,
    )
