"""What every remote adapter uses, whatever its vendor: the verl fields an adapter reads (``verl_settings``).
The strict config conversion and the rollout batching options are the generic layer's
(``verl.remote_backend.strict_config``, ``verl.remote_backend.workers.batching``). Nothing here names a vendor;
importing the package imports no module of it."""
