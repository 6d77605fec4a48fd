"""``ArcticRLActorRolloutRefWorker``: verl's actor/ref worker for the ``arctic`` backend.

A thin registered subclass of the generic
:class:`~verl.remote_backend.workers.worker.RemoteActorRolloutRefWorker` (it keeps its name: it is
the documented entry point of the Arctic backend). Every call is forwarded, unchanged, to the
``ArcticRLClient`` adapter the worker re-attaches from the driver's handle.
"""

from __future__ import annotations

from verl.remote_backend.workers.worker import RemoteActorRolloutRefWorker

__all__ = ["ArcticRLActorRolloutRefWorker"]


class ArcticRLActorRolloutRefWorker(RemoteActorRolloutRefWorker):
    """Forwarder worker: verl's actor/rollout/ref role, computed by an Arctic RL server's jobs
    (training job: old log-probs and updates; log_prob job: reference log-probs)."""
