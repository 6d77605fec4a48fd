"""The server's jobs: the registry of created jobs, what each endpoint does to one, and checkpoint layout.

==========================  =====================================================================
module                      what it is
==========================  =====================================================================
:mod:`.registry`            :class:`~.registry.Job` (config, engine, lock, state) and the registry
:mod:`.service`             :class:`~.service.ServerState`: what each endpoint does, on which job
:mod:`.background_setup`    a job's building and warm-up as one task: ``/initialize`` answers before the warm-up
:mod:`.setup_hold`          the samplers asleep while a training or log-prob job is built and warmed up
:mod:`.sleep_gate`          the passes wait for a sampler's sleep that is under way
:mod:`.checkpoint`          where a training job's checkpoints live on disk, and their names
==========================  =====================================================================
"""
