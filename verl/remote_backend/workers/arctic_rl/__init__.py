"""verl's side of the Arctic RL backend: the forwarder worker (``worker.py``:
``ArcticRLActorRolloutRefWorker``), the ``arctic`` rollout replica and its server actor
(``replica.py``) and the request coalescer they use (``coalescer.py``).

Nothing is imported here on purpose: ``verl.remote_backend.builtin`` registers lazy loaders, so a
process pays for ray/tensordict/verl imports only when it really builds a worker or a replica.
The HTTP adapter itself (``ArcticRLClient``) lives in ``verl.workers.remote_client``.
"""
