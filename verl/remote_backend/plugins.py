"""Backends from other distributions: the public registration call and the entry points that find them.

A backend is three things registered under one name: the adapter class (a
:class:`~verl.remote_backend.base.RemoteBackend`), the Ray worker class verl's trainer builds, and the
rollout replica class verl's agent loop asks for (in our registry *and* in verl's
``RolloutReplicaRegistry``, so that ``actor_rollout_ref.rollout.name=<name>`` resolves).
:func:`register_backend` does all of it in one call; the built-in backends use it too.

An installed distribution becomes a backend with no edit to this repository by declaring, in its
``pyproject.toml``::

    [project.entry-points."verl_remote_backend.backends"]
    mybackend = "my_pkg.verl_plugin:register"       # a zero-argument callable calling register_backend

    [project.entry-points."verl_remote_backend.configs"]
    mybackend = "my_pkg.config"                      # a package holding remote_backend/mybackend.yaml

:func:`load_plugins` (run when ``verl.remote_backend.builtin`` is imported, in every process that
looks a backend up) calls each registration callable once; the Hydra search-path plugin adds each
config package to verl's search path (:func:`config_packages`). Two distributions claiming one name,
a name taken by a built-in backend, or a plug-in that fails to import or register stop the start-up
with an error naming the distribution(s).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib import metadata
from typing import Any

from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "BACKEND_GROUP",
    "CONFIG_GROUP",
    "GENERIC_REPLICA",
    "GENERIC_WORKER",
    "config_packages",
    "load_plugins",
    "plugin_entry_points",
    "register_backend",
]

#: entry-point group of registration callables (name = backend name)
BACKEND_GROUP = "verl_remote_backend.backends"
#: entry-point group of config packages holding ``remote_backend/<name>.yaml`` (name = backend name)
CONFIG_GROUP = "verl_remote_backend.configs"
#: the generic forwarder worker and rollout replica (a backend without its own uses these)
GENERIC_WORKER = "verl.remote_backend.workers.worker:RemoteActorRolloutRefWorker"
GENERIC_REPLICA = "verl.remote_backend.workers.replica:RemoteRolloutReplica"

ClassRef = type | str | Callable[[], type]
_loaders: dict[tuple[str, str, Any], Callable[[], type]] = {}
_loaded_plugins: dict[str, str] = {}  # backend name -> distribution that registered it
_lock = threading.RLock()


def _loader(name: str, kind: str, ref: ClassRef) -> Callable[[], type]:
    """One zero-argument loader per (backend, kind, reference): registering twice is then a no-op."""
    key = (name, kind, ref)
    with _lock:
        if key in _loaders:
            return _loaders[key]
        if isinstance(ref, type):
            def load() -> type:
                return ref
        elif isinstance(ref, str):
            module_name, sep, attr = ref.partition(":")
            if not sep or not module_name or not attr:
                raise RemoteBackendConfigError(f"register_backend({name!r}).{kind}", "expected 'module:Class'",
                                               allowed="a class, 'module:Class' or a zero-argument loader",
                                               received=ref)

            def load() -> type:
                return getattr(importlib.import_module(module_name), attr)
        elif callable(ref):
            load = ref
        else:
            raise RemoteBackendConfigError(f"register_backend({name!r}).{kind}", "not a class reference",
                                           allowed="a class, 'module:Class' or a zero-argument loader",
                                           received=repr(ref))
        _loaders[key] = load
        return load


def register_backend(name: str, backend_cls: type[RemoteBackend], *, worker: ClassRef = GENERIC_WORKER,
                     replica: ClassRef = GENERIC_REPLICA) -> None:
    """Register backend ``name`` everywhere verl looks it up.

    Args:
        name: what ``remote_backend=<name>`` selects (and ``actor_rollout_ref.rollout.name`` becomes).
        backend_cls: the adapter, a :class:`RemoteBackend` subclass that also offers
            :class:`~verl.remote_backend.protocols.RemoteActor` and
            :class:`~verl.remote_backend.protocols.RemoteSampler`.
        worker: the Ray worker class (a ``RemoteActorRolloutRefWorker`` subclass), as a class, a
            ``"module:Class"`` string (imported on first use) or a zero-argument loader.
        replica: the rollout replica class (a ``RemoteRolloutReplica`` subclass), same forms.

    Idempotent for the same arguments; a different class under a taken name raises ``ValueError``
    naming both, and so does a name verl already uses for a rollout engine of its own (``vllm``, ...).
    """
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    load_worker = _loader(name, "worker", worker)
    load_replica = _loader(name, "replica", replica)
    # verl's registry overwrites silently (a dict): refuse to shadow one of verl's own rollout engines
    existing = RolloutReplicaRegistry._registry.get(name)
    if existing is not None and existing is not load_replica and name not in RemoteBackendRegistry.list():
        raise ValueError(f"remote backend name {name!r} is taken by verl's own rollout engine {existing!r}; "
                         "choose another name")
    RemoteBackendRegistry.register(name)(backend_cls)
    RemoteBackendRegistry.register_worker(name, load_worker)
    RemoteBackendRegistry.register_replica(name, load_replica)
    RolloutReplicaRegistry.register(name, load_replica)


def _distribution(entry: metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    if dist is None:
        return f"the distribution declaring {entry.value!r}"
    return f"{dist.metadata['Name']} {dist.version}"


def plugin_entry_points(group: str = BACKEND_GROUP) -> dict[str, list[metadata.EntryPoint]]:
    """Entry points of ``group`` by name (the same declaration found twice on ``sys.path`` counts once)."""
    found: dict[str, list[metadata.EntryPoint]] = {}
    for entry in metadata.entry_points(group=group):
        same = [e for e in found.get(entry.name, []) if e.value == entry.value and _distribution(e) == _distribution(entry)]
        if not same:
            found.setdefault(entry.name, []).append(entry)
    return found


def _claimants(name: str, entries: list[metadata.EntryPoint]) -> str:
    return " and ".join(f"{_distribution(e)} ({e.value})" for e in entries)


def load_plugins(builtin: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Call every installed plug-in's registration callable once; return the names they provide.

    ``builtin`` holds the names this distribution registers itself: a plug-in may not take one.
    """
    names = []
    for name, entries in sorted(plugin_entry_points().items()):
        if len(entries) > 1:
            raise RemoteBackendConfigError(
                f"entry point {BACKEND_GROUP}:{name}",
                f"two installed distributions claim the remote backend name {name!r}: {_claimants(name, entries)}; "
                "uninstall one of them", allowed="one distribution per backend name", received=len(entries))
        entry = entries[0]
        if name in builtin:
            raise RemoteBackendConfigError(
                f"entry point {BACKEND_GROUP}:{name}",
                f"{_distribution(entry)} claims {name!r}, the name of a built-in backend; rename its entry point",
                allowed=f"a name other than {sorted(builtin)}", received=name)
        with _lock:
            if name in _loaded_plugins:
                names.append(name)
                continue
            try:
                register = entry.load()
            except Exception as exc:
                raise RemoteBackendConfigError(
                    f"entry point {BACKEND_GROUP}:{name}",
                    f"the remote backend plug-in {name!r} of {_distribution(entry)} failed to import "
                    f"({type(exc).__name__}: {exc})", allowed="an importable 'module:function'",
                    received=entry.value) from exc
            if not callable(register):
                raise RemoteBackendConfigError(
                    f"entry point {BACKEND_GROUP}:{name}",
                    f"the remote backend plug-in {name!r} of {_distribution(entry)} is not callable",
                    allowed="a zero-argument function calling register_backend", received=repr(register))
            try:
                register()
            except Exception as exc:
                raise RemoteBackendConfigError(
                    f"entry point {BACKEND_GROUP}:{name}",
                    f"the remote backend plug-in {name!r} of {_distribution(entry)} failed to register "
                    f"({type(exc).__name__}: {exc})", received=entry.value) from exc
            if name not in RemoteBackendRegistry.list():
                raise RemoteBackendConfigError(
                    f"entry point {BACKEND_GROUP}:{name}",
                    f"the remote backend plug-in {name!r} of {_distribution(entry)} ran but registered no backend "
                    f"under its entry-point name", allowed=f"register_backend({name!r}, ...)",
                    received=RemoteBackendRegistry.list())
            _loaded_plugins[name] = _distribution(entry)
        names.append(name)
    return names


def config_packages() -> list[str]:
    """The config packages installed plug-ins declare (``pkg://`` entries of verl's Hydra search path,
    added by ``hydra_plugins/verl_remote_backend_searchpath``)."""
    return sorted({entry.value for entries in plugin_entry_points(CONFIG_GROUP).values() for entry in entries})
