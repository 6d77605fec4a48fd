"""verl.remote_backend: run verl's actor training, log-probs and generation on a remote backend.

This package is installed into PyPI verl's ``verl`` namespace by the ``verl-remote-backend``
distribution; it adds files and changes none of verl's. ``RemoteBackend`` is the lifecycle
contract, ``RemoteBackendRegistry`` the explicit name -> backend/worker/replica registry.
Importing this package imports no backend: ``verl.remote_backend.register`` loads the built-in ones.
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
