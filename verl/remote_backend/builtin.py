"""Register the built-in remote backends (``arctic``, ``tinker``) and the installed plug-ins.

Each built-in backend is registered with the public :func:`~verl.remote_backend.plugins.register_backend`
an out-of-tree backend uses too (adapter class, Ray worker and rollout replica, verl's
``RolloutReplicaRegistry`` included); then :func:`~verl.remote_backend.plugins.load_plugins` runs the
registration callable of every installed distribution declaring a ``verl_remote_backend.backends``
entry point. The worker and replica classes are loaded lazily (``"module:Class"``), and an adapter
module imports its vendor SDK only when the backend is created, so registering costs no optional
dependency. A backend without vendor-specific worker/replica code uses the generic ones
(``RemoteActorRolloutRefWorker``, ``RemoteRolloutReplica``).

Idempotent: importing this module (``verl.remote_backend.context.ensure_backends_registered``) is how
every process -- the driver, the Ray task runner, the workers -- gets the same registry. The verl
trainer mode is registered by ``verl.remote_backend.register`` (the plugin hook), which imports this.
"""

from __future__ import annotations

import importlib

from verl.remote_backend.plugins import GENERIC_REPLICA, GENERIC_WORKER, load_plugins, register_backend

__all__ = ["BUILTIN_BACKENDS", "register_builtin_backends"]

#: backend name -> (adapter "module:Class", worker "module:Class", replica "module:Class")
BUILTIN_BACKENDS: dict[str, tuple[str, str, str]] = {
    "arctic": (
        "verl.workers.remote_client.arctic.arctic_rl:ArcticRLClient",
        "verl.workers.remote_client.arctic.worker:ArcticRLActorRolloutRefWorker",
        "verl.workers.remote_client.arctic.replica:ArcticRLRolloutReplica",
    ),
    "tinker": (
        "verl.workers.remote_client.tinker:TinkerClient",
        GENERIC_WORKER,
        GENERIC_REPLICA,
    ),
}


def register_builtin_backends() -> None:
    """Register each built-in backend, then the installed plug-ins (idempotent)."""
    for name, (adapter, worker, replica) in BUILTIN_BACKENDS.items():
        module_name, _, attr = adapter.partition(":")
        register_backend(name, getattr(importlib.import_module(module_name), attr), worker=worker, replica=replica)
    load_plugins(builtin=frozenset(BUILTIN_BACKENDS))


register_builtin_backends()
