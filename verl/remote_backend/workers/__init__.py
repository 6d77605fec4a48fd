"""Ray workers and rollout replicas that put verl's actor, reference and rollout roles on a
remote backend, one sub-package per backend (``arctic_rl``). Importing this package imports
no backend; the loaders in ``verl.remote_backend.builtin`` do, on first use."""
