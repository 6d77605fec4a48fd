"""The remote-backend lifecycle contract and its registry.

``RemoteBackend`` is deliberately small: it is the *lifecycle* of a backend that lives in another
service -- what verl's trainer drives once per run or once per step: create or re-attach
(``from_config``), hand out a handle (``reconnect_handle``), release (``destroy``), say whether one
worker forwards (``requires_single_forwarder``), and the two per-step hooks ``update_weights`` and
``save_checkpoint``. These are exactly the abstract methods of verl's PR #7102, so a backend moves
between the two unchanged. It is not a vehicle for code reuse and it declares no compute: what verl's
worker and rollout server call on data (``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor``,
``load_checkpoint``, ``generate``) is declared once, in the Protocols of
:mod:`verl.remote_backend.protocols`. :mod:`verl.remote_backend.contract` checks a backend against both.

``RemoteBackendRegistry`` maps names (``remote_backend=arctic``) to backend classes, Ray worker
classes and rollout replica classes. Registration has one way:
:func:`verl.remote_backend.plugins.register_backend` fills all three (and verl's own
``RolloutReplicaRegistry``) in one call, for the built-in backends and for plug-ins found through
entry points; worker and replica classes are registered as zero-argument *loaders* so that looking one
up imports only that backend's code, once. :meth:`RemoteBackendRegistry.register` (PR #7102's class
decorator) fills the backend table only; it stays for backends written for that PR.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

__all__ = ["RemoteBackend", "RemoteBackendRegistry"]


class RemoteBackend(abc.ABC):
    """Lifecycle of a remote backend. Subclasses are constructed only through :meth:`from_config`.

    The same abstract methods as verl's open PR #7102 (``verl/remote_backend/base.py`` there), with two
    differences a backend written for one must mind on the other (``docs/ADDING_A_BACKEND.md``):
    ``update_weights`` and ``save_checkpoint`` are plain methods here (the worker runs them in a
    thread; a coroutine function is awaited as well), and ``save_checkpoint`` takes verl's global step.
    A backend also implements the compute Protocols (:mod:`verl.remote_backend.protocols`).
    """

    @classmethod
    @abc.abstractmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> RemoteBackend:
        """Create the backend's remote state from verl's main config, or re-attach to it.

        With ``handle`` (a dict from :meth:`reconnect_handle`, possibly made in another process)
        nothing new is created on the server: the instance talks to the live backend.
        """

    @abc.abstractmethod
    def reconnect_handle(self) -> dict[str, Any]:
        """A JSON-serializable dict from which :meth:`from_config` re-attaches. Holds no secrets."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release what this instance created on the server. Idempotent."""

    @abc.abstractmethod
    def update_weights(self) -> Mapping[str, Any] | None:
        """Make the sampler serve the latest trained weights. A mapping holding
        :data:`~verl.remote_backend.protocols.SAMPLER_UPDATE_KEY` is handed to the rollout servers
        (:class:`~verl.remote_backend.protocols.SamplerAdopter`)."""

    @abc.abstractmethod
    def save_checkpoint(self, step: int | None = None) -> Mapping[str, Any]:
        """Persist the remote training state (weights, optimizer, step) on the backend as verl's
        global step ``step`` (``None``: the backend's own step count); returns what was saved
        (e.g. ``{"global_step": ..., "path": ...}``), JSON-serializable."""

    @abc.abstractmethod
    def requires_single_forwarder(self) -> bool:
        """True when exactly one verl worker must forward calls (the backend shards itself)."""


_T = TypeVar("_T")
Loader = Callable[[], Any]


class _Table:
    """One name -> object table with the duplicate and unknown-name rules of the registry."""

    def __init__(self, kind: str, how_to_register: str):
        self.kind = kind
        self.how_to_register = how_to_register
        self.entries: dict[str, Any] = {}
        self.lock = threading.Lock()

    def put(self, name: str, obj: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name: expected a non-empty string, received {name!r}")
        with self.lock:
            current = self.entries.get(name)
            if current is None:
                self.entries[name] = obj
            elif current is not obj:
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered to {_describe(current)}; "
                    f"refusing to register {_describe(obj)} under the same name"
                )

    def take(self, name: str) -> Any:
        try:
            return self.entries[name]
        except KeyError:
            known = sorted(self.entries)
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: {known or 'none'}. {self.how_to_register}"
            ) from None


def _describe(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}" if module else qualname


class RemoteBackendRegistry:
    """Explicit registry of backends, their Ray workers and their rollout replicas.

    Re-registering the same object under a name is a no-op; a different object under a taken
    name raises ``ValueError`` naming both; an unknown name raises ``KeyError`` listing the
    registered names and how to register one.
    """

    _backends: ClassVar[_Table] = _Table(
        "remote backend",
        "Register one with verl.remote_backend.plugins.register_backend('<name>', ...), from an installed "
        "distribution's 'verl_remote_backend.backends' entry point (see docs/ADDING_A_BACKEND.md); the built-in "
        "ones and the plug-ins load with `import verl.remote_backend.builtin`.",
    )
    _workers: ClassVar[_Table] = _Table(
        "remote backend worker",
        "Register a zero-argument loader with RemoteBackendRegistry.register_worker('<name>', loader).",
    )
    _replicas: ClassVar[_Table] = _Table(
        "remote backend rollout replica",
        "Register a zero-argument loader with RemoteBackendRegistry.register_replica('<name>', loader).",
    )
    _loaded: ClassVar[dict[tuple[str, str], Any]] = {}

    # backends ---------------------------------------------------------------------------
    @classmethod
    def register(cls, name: str) -> Callable[[type[_T]], type[_T]]:
        """Class decorator of PR #7102 (``@RemoteBackendRegistry.register("acme")``): the backend table only.
        Register with :func:`verl.remote_backend.plugins.register_backend`, which calls this."""

        def decorate(backend_cls: type[_T]) -> type[_T]:
            if not (isinstance(backend_cls, type) and issubclass(backend_cls, RemoteBackend)):
                raise TypeError(f"remote backend {name!r}: expected a RemoteBackend subclass, received {backend_cls!r}")
            cls._backends.put(name, backend_cls)
            return backend_cls

        return decorate

    @classmethod
    def get(cls, name: str) -> type[RemoteBackend]:
        return cls._backends.take(name)

    @classmethod
    def create(cls, name: str, main_config: Any, *, handle: dict | None = None) -> RemoteBackend:
        """``get(name).from_config(main_config, handle=handle)``."""
        return cls.get(name).from_config(main_config, handle=handle)

    @classmethod
    def list(cls) -> list[str]:
        """The registered backend names, sorted (built-in and plug-in ones once
        ``verl.remote_backend.builtin`` is imported)."""
        return sorted(cls._backends.entries)

    # workers and replicas (lazy) ----------------------------------------------------------
    @classmethod
    def register_worker(cls, name: str, loader: Loader) -> None:
        """``loader()`` returns the Ray worker class of backend ``name``; called on first use."""
        cls._workers.put(name, _check_loader(name, loader))

    @classmethod
    def get_worker(cls, name: str) -> type:
        return cls._load("worker", cls._workers, name)

    @classmethod
    def register_replica(cls, name: str, loader: Loader) -> None:
        """``loader()`` returns the rollout replica class of backend ``name``; called on first use."""
        cls._replicas.put(name, _check_loader(name, loader))

    @classmethod
    def get_replica(cls, name: str) -> type:
        return cls._load("replica", cls._replicas, name)

    @classmethod
    def _load(cls, kind: str, table: _Table, name: str) -> Any:
        key = (kind, name)
        if key not in cls._loaded:
            loader = table.take(name)
            cls._loaded[key] = loader()
        return cls._loaded[key]


def _check_loader(name: str, loader: Loader) -> Loader:
    if not callable(loader):
        raise TypeError(f"loader for {name!r}: expected a zero-argument callable, received {loader!r}")
    return loader
