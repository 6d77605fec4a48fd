"""How the driver's remote backend reaches verl's Ray worker and rollout replica.

verl 0.9.1 builds the actor worker with ``config=config.actor_rollout_ref`` and the rollout
replica with ``config=config.actor_rollout_ref.rollout`` (``RolloutReplica.__init__`` takes no
extra arguments), so the one config node both receive is ``actor_rollout_ref.rollout``. Its
``custom`` field is verl's documented extension point; the driver writes a
:class:`BackendContext` there under the key ``remote_backend``:

* ``name``: the backend's registry name (``arctic``);
* ``handle``: the backend's :meth:`~verl.remote_backend.RemoteBackend.reconnect_handle` (never
  a token: each process reads its token from config or environment itself);
* ``main_config``: a resolved snapshot of verl's main config (without this context), because a
  backend's ``from_config`` reads ``remote_backend``, ``trainer``, ``data`` and
  ``actor_rollout_ref`` while each Ray actor only sees a sub-node. It travels as a JSON string:
  verl instantiates the rollout node's ``_target_`` dataclasses recursively, and the snapshot's
  own ``_target_`` keys must stay inert data.

Every process then calls :func:`attach_backend` to re-attach to the live backend. This module
creates nothing remote and owns no lifecycle (that is ``verl.remote_backend.trainer``'s job).
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.errors import RemoteBackendConfigError

__all__ = [
    "CONTEXT_FIELD",
    "BackendContext",
    "attach_backend",
    "ensure_backends_registered",
    "install_context",
    "read_context",
]

#: dotted path of the context inside verl's main config
CONTEXT_FIELD = "actor_rollout_ref.rollout.custom.remote_backend"
_REGISTER_MODULE = "verl.remote_backend.builtin"


@dataclass(frozen=True)
class BackendContext:
    """What a Ray actor needs to re-attach to the driver's backend (see the module docstring)."""

    name: str
    handle: dict | None
    main_config: dict

    def to_dict(self) -> dict:
        return {"name": self.name, "handle": copy.deepcopy(self.handle), "main_config": json.dumps(self.main_config)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, where: str = CONTEXT_FIELD) -> BackendContext:
        if isinstance(data, DictConfig):
            data = OmegaConf.to_container(data, resolve=True)
        missing = [k for k in ("name", "handle", "main_config") if k not in data]
        if missing:
            raise RemoteBackendConfigError(where, "incomplete remote backend context", allowed="keys name, handle, main_config", received=sorted(data))
        handle = data["handle"]
        if handle is not None and not isinstance(handle, Mapping):
            raise RemoteBackendConfigError(f"{where}.handle", "expected a mapping or null", received=type(handle).__name__)
        main_config = data["main_config"]
        if isinstance(main_config, str):
            main_config = json.loads(main_config)
        if not isinstance(main_config, Mapping):
            raise RemoteBackendConfigError(f"{where}.main_config", "expected a JSON object", received=type(main_config).__name__)
        return cls(name=str(data["name"]), handle=None if handle is None else dict(handle), main_config=dict(main_config))

    def main_config_node(self) -> DictConfig:
        """The main config snapshot as a DictConfig (what ``RemoteBackend.from_config`` takes)."""
        return OmegaConf.create(copy.deepcopy(self.main_config))


def ensure_backends_registered() -> None:
    """Import ``verl.remote_backend.builtin`` (idempotent): registers the built-in backends."""
    importlib.import_module(_REGISTER_MODULE)


def _snapshot(config: DictConfig) -> dict:
    snapshot = OmegaConf.to_container(config, resolve=True)
    custom = (snapshot.get("actor_rollout_ref") or {}).get("rollout", {}).get("custom")
    if isinstance(custom, dict):
        custom.pop("remote_backend", None)
        if not custom:
            snapshot["actor_rollout_ref"]["rollout"]["custom"] = None
    return snapshot


def install_context(config: DictConfig, *, name: str, handle: dict | None) -> BackendContext:
    """Write the context for backend ``name`` into ``config`` (in place) and return it."""
    context = BackendContext(name=name, handle=None if handle is None else dict(handle), main_config=_snapshot(config))
    rollout = config.actor_rollout_ref.rollout
    with open_dict(rollout):
        if rollout.get("custom") is None:
            rollout.custom = {}
        with open_dict(rollout.custom):
            rollout.custom["remote_backend"] = context.to_dict()
    return context


def read_context(source: Any, *, where: str = CONTEXT_FIELD) -> BackendContext:
    """Find the context in a main config, an ``actor_rollout_ref`` node, a rollout node/dataclass
    or a ``custom`` mapping. Raises :class:`RemoteBackendConfigError` when it is absent."""
    node = source
    for attr in ("actor_rollout_ref", "rollout"):
        child = _get(node, attr)
        if child is not None:
            node = child
    custom = _get(node, "custom")
    if custom is None and isinstance(node, Mapping) and "remote_backend" in node:
        custom = node
    data = _get(custom, "remote_backend") if custom is not None else None
    if data is None:
        raise RemoteBackendConfigError(
            where,
            "no remote backend context: this worker/replica only runs under the remote-backend trainer "
            "(`python -m verl.remote_backend.main_ppo ... remote_backend=<name>`, or stock main_ppo with "
            "VERL_USE_EXTERNAL_MODULES=verl.remote_backend.register trainer.v1.trainer_mode=remote_backend)",
            received=None,
        )
    return BackendContext.from_mapping(data, where=where)


def attach_backend(context: BackendContext) -> RemoteBackend:
    """Re-attach to the live backend described by ``context`` (creates nothing on the server)."""
    if not context.handle:
        raise RemoteBackendConfigError(f"{CONTEXT_FIELD}.handle", "no backend handle: the driver has not created the backend yet", received=context.handle)
    ensure_backends_registered()
    return RemoteBackendRegistry.create(context.name, context.main_config_node(), handle=context.handle)


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    if isinstance(node, Mapping):
        return node.get(key)
    return getattr(node, key, None)
