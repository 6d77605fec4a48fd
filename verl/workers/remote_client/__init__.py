"""verl.workers.remote_client: the vendors' adapters that drive a remote backend, one folder per vendor.

* ``arctic/`` -- ``remote_backend=arctic``: ``ArcticRLClient``, the HTTP client of an Arctic RL
  server (reference server ``arctic_rl.server`` or the vendor's v1/v2), with its forwarder worker
  ``ArcticRLActorRolloutRefWorker`` and its ``arctic`` rollout replica;
* ``tinker/`` -- ``remote_backend=tinker``: ``TinkerClient`` on the official ``tinker`` SDK (generic
  worker and replica);
* ``common/`` -- what both use and names no vendor: the verl fields an adapter reads
  (``verl_settings``); strict config mirrors and the rollout batching options are in ``verl.remote_backend``.

``verl.remote_backend.builtin`` registers each vendor's adapter (with ``register_backend``, the one way a
backend is registered); importing this package imports no vendor and registers nothing.
"""
