"""verl.workers.remote_client: client adapters that drive a remote backend over HTTP.

``arctic_rl.ArcticRLClient`` (registered as ``"arctic"`` in ``RemoteBackendRegistry``) speaks the
Arctic RL protocol. One concept per module:

* ``arctic_config`` -- ``config.remote_backend`` as typed, validated dataclasses (mirrors arctic.yaml);
* ``verl_settings`` -- the standard verl fields the adapter reads;
* ``builders`` -- ds_config / ds_worker_config / JobConfig / loss config / call meta (pure functions);
* ``layout`` -- verl's nested batches <-> the server's ``[left-padded prompt | response]`` layout;
* ``http`` -- session, time limits, retries, error mapping; ``wire`` -- v1/v2 bodies and detection;
* ``jobs`` -- health, job creation/destruction, handles; ``generation`` -- ``/generate`` helpers;
* ``metrics`` -- verl metric names and MFU; ``local_server`` -- a local reference server process.

Importing this package imports none of them: ``import verl.workers.remote_client.arctic_rl``
registers the adapter.
"""
