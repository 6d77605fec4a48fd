"""The Tinker adapter: ``remote_backend=tinker`` on the official ``tinker`` SDK.

``TinkerClient`` is registered as ``tinker`` by ``verl.remote_backend.builtin`` (with ``register_backend``;
importing this package registers nothing); the SDK itself is imported only when a backend is created
(``pip install '.[tinker]'``, Python >= 3.11).
Modules: ``config`` (the yaml's dataclass mirror), ``options`` (verl options supported, emulated,
refused), ``batch`` (verl batches <-> datums), ``sdk`` (every SDK call), ``sampling`` (generation),
``checkpoints`` (resume index), ``client`` (the backend).
"""

from verl.workers.remote_client.tinker.client import TinkerClient

__all__ = ["TinkerClient"]
