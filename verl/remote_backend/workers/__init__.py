"""Ray workers and rollout replicas that put verl's actor, reference and rollout roles on a
remote backend: the generic forwarder worker (``worker.py``), rollout replica and server
(``replica.py``) and request coalescer (``coalescer.py``), plus one sub-package per backend that
needs thin subclasses of them (``arctic_rl``). Importing this package imports no backend; the
loaders in ``verl.remote_backend.builtin`` do, on first use."""
