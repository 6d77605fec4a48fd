"""Ray workers and rollout replicas that put verl's actor, reference and rollout roles on a remote
backend: the generic forwarder worker (``worker.py``), rollout replica and server (``replica.py``), the
batching options every backend's ``rollout`` node holds (``batching.py``), the request coalescer
(``coalescer.py``) and the per-prompt sample grouper (``sample_groups.py``). A backend that needs thin
subclasses of them keeps those in its own adapter folder (``verl.workers.remote_client.<vendor>``).
Importing this package imports no backend; the loaders in ``verl.remote_backend.builtin`` do, on first use."""
