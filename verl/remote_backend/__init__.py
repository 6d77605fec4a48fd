"""verl.remote_backend: run verl's actor training, log-probs and generation on a remote backend.

This package is installed into PyPI verl's ``verl`` namespace by the ``verl-remote-backend``
distribution; it adds files and changes none of verl's. ``RemoteBackend`` is the lifecycle
contract (PR #7102's six abstract methods), the compute calls are the Protocols of
``verl.remote_backend.protocols``, ``RemoteBackendRegistry`` the explicit name -> backend/worker/replica
registry, filled by ``verl.remote_backend.plugins.register_backend``, and ``verl.remote_backend.contract``
the kit that checks a backend. Importing this package imports no backend: ``verl.remote_backend.builtin``
registers the built-in ones and the installed plug-ins (``verl.remote_backend.register``, verl's plug-in
hook, imports it).
"""

from verl.remote_backend.base import RemoteBackend, RemoteBackendRegistry
from verl.remote_backend.errors import (
    RemoteBackendConfigError,
    RemoteBackendError,
    RemoteConnectionError,
    RemoteJobNotFoundError,
    RemoteProtocolError,
    RemoteServerError,
    RemoteTimeoutError,
)

__all__ = [
    "RemoteBackend",
    "RemoteBackendConfigError",
    "RemoteBackendError",
    "RemoteBackendRegistry",
    "RemoteConnectionError",
    "RemoteJobNotFoundError",
    "RemoteProtocolError",
    "RemoteServerError",
    "RemoteTimeoutError",
]
