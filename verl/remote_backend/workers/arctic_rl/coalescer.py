"""The request coalescer of the ``arctic`` rollout server (kept importable under its old path).

The implementation is generic and lives in :mod:`verl.remote_backend.workers.coalescer`.
"""

from verl.remote_backend.workers.coalescer import RequestAborted, RequestCoalescer, params_key

__all__ = ["RequestAborted", "RequestCoalescer", "params_key"]
