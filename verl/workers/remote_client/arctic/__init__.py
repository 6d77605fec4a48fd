"""The Arctic RL adapter: ``remote_backend=arctic``, the client of an Arctic RL server over HTTP.

``arctic_rl.ArcticRLClient`` (registered as ``"arctic"`` by ``verl.remote_backend.builtin``, with
``register_backend``) is the session (jobs, handle, destroy) and delegates the rest by role. One
concept per module:

* ``arctic_config`` -- ``config.remote_backend`` as typed, validated dataclasses (mirrors arctic.yaml);
* ``builders`` -- ds_config / ds_worker_config / JobConfig / loss config / call meta (pure functions);
* ``dialect`` -- what differs between wire v1 and v2 (paths, codec, bodies), one object per version;
* ``state`` -- the run's shared state (job ids, step, instance id, owned and retired jobs);
* ``request`` -- one call to a job, as data; ``session`` -- what the roles call (``JobCalls``), through
  ``recovery.Recovery.call``, the one call path (``CallResult``, the pure ``decide``);
* ``answers`` -- answers read through their models in ``arctic_rl.protocol``;
* ``training`` -- ``update_actor`` and ``/step``, and a recovery checkpoint when ``checkpoint_schedule`` says
  one is due; ``log_probs`` -- ``compute_(ref_)log_prob``;
* ``generation`` -- ``/generate``; ``checkpoints`` -- weight sync, save, load;
* ``layout`` -- verl's nested batches <-> the server's ``[left-padded prompt | response]`` layout;
* ``http`` -- session, time limits, retries, error mapping; ``wire`` -- protocol detection;
* ``jobs`` -- health, job creation/destruction, handles;
* ``recovery`` -- the retry rule every call goes through, by role: ``settle`` (was a lost call applied?),
  ``restart`` (did the server restart?), ``restore`` (restore, rebuild, adopt), ``watcher``; ``journal`` --
  the updates since the last checkpoint;
* ``metrics`` -- verl metric names and MFU; ``local_server`` -- a local reference server process;
* ``worker`` -- ``ArcticRLActorRolloutRefWorker``, verl's forwarder worker under its documented name;
* ``replica`` -- the ``arctic`` rollout replica and server (verl's sampling parameters -> the protocol's).

The verl fields the adapter reads come from :mod:`verl.workers.remote_client.common.verl_settings`.
Importing this package imports none of them: ``verl.remote_backend.builtin`` imports
``arctic_rl`` (the registration) and loads ``worker``/``replica`` lazily, so a process pays for
ray/tensordict/verl imports only when it builds a worker or a replica.
"""
