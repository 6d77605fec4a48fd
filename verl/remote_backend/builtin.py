"""Register the built-in remote backends (``arctic``, ``tinker``) in every registry that needs them.

* the adapter class: importing its module (``verl.workers.remote_client.arctic.arctic_rl``, ...) runs its
  ``@RemoteBackendRegistry.register("<name>")``; an adapter module imports its vendor SDK only
  when the backend is created, so registering costs no optional dependency;
* the Ray worker and the rollout replica: lazy loaders in ``RemoteBackendRegistry``
  (``register_worker`` / ``register_replica``) and, for the replica, in verl's own
  ``RolloutReplicaRegistry`` (so ``actor_rollout_ref.rollout.name=<name>`` resolves). A backend
  without vendor-specific worker/replica code uses the generic ones
  (``RemoteActorRolloutRefWorker``, ``RemoteRolloutReplica``).

Cheap and idempotent: no worker, replica or trainer module is imported here. The verl trainer
mode is registered by ``verl.remote_backend.register`` (the plugin hook), which imports this.
"""

from __future__ import annotations

import importlib

from verl.remote_backend.base import RemoteBackendRegistry

__all__ = ["BUILTIN_BACKENDS", "register_builtin_backends"]

#: backend name -> (adapter module, worker "module:Class", replica "module:Class")
BUILTIN_BACKENDS: dict[str, tuple[str, str, str]] = {
    "arctic": (
        "verl.workers.remote_client.arctic.arctic_rl",
        "verl.workers.remote_client.arctic.worker:ArcticRLActorRolloutRefWorker",
        "verl.workers.remote_client.arctic.replica:ArcticRLRolloutReplica",
    ),
    "tinker": (
        "verl.workers.remote_client.tinker",
        "verl.remote_backend.workers.worker:RemoteActorRolloutRefWorker",
        "verl.remote_backend.workers.replica:RemoteRolloutReplica",
    ),
}


def _loader(target: str):
    module_name, _, attr = target.partition(":")

    def load() -> type:
        return getattr(importlib.import_module(module_name), attr)

    load.__qualname__ = f"load<{target}>"
    return load


_LOADERS = {
    name: (_loader(worker), _loader(replica)) for name, (_adapter, worker, replica) in BUILTIN_BACKENDS.items()
}


def register_builtin_backends() -> None:
    """Import each built-in adapter and register its worker/replica loaders (idempotent)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    for name, (adapter_module, _worker, _replica) in BUILTIN_BACKENDS.items():
        importlib.import_module(adapter_module)
        load_worker, load_replica = _LOADERS[name]
        RemoteBackendRegistry.register_worker(name, load_worker)
        RemoteBackendRegistry.register_replica(name, load_replica)
        RolloutReplicaRegistry.register(name, load_replica)


register_builtin_backends()
